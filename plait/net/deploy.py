"""Settings a deployment can apply to carry out a traffic plan of whole flows.

Three forms, each marked with what it needs (C4P, HPCA'25, patched NCCL for the first):

* ``source_ports`` (needs a patched NCCL): per queue pair, a UDP source port whose hash sends
  it along its planned path (found by trying ports of the ephemeral range through the
  fabric's hash, `Fabric.route_ecmp`). Stock NCCL lets the NIC pick the port; a patched one
  sets it per QP (rdma-core's ``mlx5dv_modify_qp_udp_sport``), as C4P patched NCCL. This
  needs the switches' hash function and seed, which plait models (`plait.net.ecmp`).
* ``policy_routes`` (stock NCCL, switch configuration): per (source NIC, destination NIC)
  address pair whose queue pairs all take one path, the next hop at each switch (a leaf's
  or spine's policy-based route matching the two addresses) and the sending port of a bond.
  A pair whose queue pairs take different paths cannot be pinned by addresses alone: listed
  under ``not_pinnable``.
* ``nccl_env`` (stock NCCL): the queue pairs and channels the plan assumes
  (``NCCL_IB_QPS_PER_CONNECTION``, ``NCCL_MIN_NCHANNELS`` = ``NCCL_MAX_NCHANNELS``, ...), so
  that NCCL opens exactly the flows that were planned.

`settings(...)` returns a JSON-ready dict (``format_version`` 1); `check_settings` reads one
back and raises `SettingsError` naming the field on anything malformed.
"""

from __future__ import annotations

import ipaddress
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from plait.errors import PlaitError
from plait.net import ecmp, nccl
from plait.net.fabric import Fabric
from plait.net.flows import Flow
from plait.net.planner import Assignment

SETTINGS_VERSION = 1
PORTS = range(49152, 65536)  # the ephemeral range RoCE NICs draw source ports from
STOCK = ("nccl_env", "policy_routes")
PATCHED = ("source_ports",)


class SettingsError(PlaitError, ValueError):
    """A traffic-settings document that does not parse (the message names the field)."""


def _ip(x: int) -> str:
    return str(ipaddress.IPv4Address(x & 0xFFFFFFFF))


def source_port_for(fabric: Fabric, flow: Flow, links: tuple[int, ...]) -> int | None:
    """The first UDP source port whose ECMP and bond hashes give `flow` the path `links`."""
    base = flow.key.five_tuple()
    for port in PORTS:
        five = ecmp.FiveTuple(base.src_ip, base.dst_ip, port)
        if fabric.route_ecmp(flow.key, five).links == links:
            return port
    return None


def settings(fabric: Fabric, flows: Sequence[Flow], a: Assignment, ports: bool = True) -> dict[str, Any]:
    """The settings of assignment `a` (whole flows only; see module doc). `ports`: search each
    queue pair's source port (a few hundred hash evaluations per flow)."""
    if a.pieces:
        raise SettingsError("traffic settings: the assignment splits flows over several paths; "
                            "no stock or patched NCCL sends one queue pair on two paths -- plan whole flows")
    names = fabric.names
    cl = fabric.cluster

    def nic(node: int, r: int) -> str:
        return f"{cl.nodes[node].name}.nic{r}"

    out_ports: list[dict[str, Any]] = []
    by_pair: dict[tuple, list[int]] = defaultdict(list)
    for i, f in enumerate(flows):
        k = f.key
        links = a.routes[i].links
        by_pair[(k.src, k.src_nic, k.dst, k.dst_nic)].append(i)
        if ports:
            five = k.five_tuple()
            out_ports.append({"src": nic(k.src, k.src_nic), "dst": nic(k.dst, k.dst_nic),
                              "src_ip": _ip(five.src_ip), "dst_ip": _ip(five.dst_ip),
                              "devices": [f.src_device, f.dst_device], "qp": f.channel,
                              "udp_sport": source_port_for(fabric, f, links),
                              "path": [names[link] for link in links]})
    routes, not_pinnable = [], []
    for (sn, sr, dn, dr), idx in by_pair.items():
        paths = {a.routes[i].links for i in idx}
        five = flows[idx[0]].key.five_tuple()
        pair = {"src": nic(sn, sr), "dst": nic(dn, dr), "src_ip": _ip(five.src_ip), "dst_ip": _ip(five.dst_ip)}
        if len(paths) > 1:
            not_pinnable.append({**pair, "paths": len(paths)})
            continue
        hops = [names[link] for link in next(iter(paths))]
        routes.append({**pair, "send_port": hops[0], "next_hops": hops[1:-1], "receive_port": hops[-1]})
    return {
        "format_version": SETTINGS_VERSION,
        "cluster": cl.name,
        "flows": len(flows),
        "stock_nccl": list(STOCK),
        "patched_nccl": list(PATCHED),
        "nccl_env": nccl.settings_env(fabric.comm_channels, fabric.nccl),
        "policy_routes": routes,
        "not_pinnable": not_pinnable,
        "source_ports": out_ports,
    }


def _need(d: Any, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise SettingsError(f"traffic settings: {where}.{key}: missing")
    v = d[key]
    if not isinstance(v, kind) or isinstance(v, bool) and kind is int:
        raise SettingsError(f"traffic settings: {where}.{key}: expected {getattr(kind, '__name__', kind)}, "
                            f"got {type(v).__name__}")
    return v


def check_settings(doc: Any) -> dict[str, Any]:
    """`doc` when it is a well-formed settings document, else SettingsError naming the field."""
    if not isinstance(doc, dict):
        raise SettingsError("traffic settings: expected a mapping")
    v = _need(doc, "format_version", "settings", int)
    if v != SETTINGS_VERSION:
        raise SettingsError(f"traffic settings: format_version: {v} is not supported (this plait reads "
                            f"{SETTINGS_VERSION})")
    env = _need(doc, "nccl_env", "settings", dict)
    for k, x in env.items():
        if not (k.startswith("NCCL_") and isinstance(x, str)):
            raise SettingsError(f"traffic settings: nccl_env.{k}: expected an NCCL_* variable with a string value")
        if k != "NCCL_ALGO" and not x.isdigit():
            raise SettingsError(f"traffic settings: nccl_env.{k}: expected a non-negative integer, got {x!r}")
    for i, r in enumerate(_need(doc, "policy_routes", "settings", list)):
        w = f"policy_routes[{i}]"
        for key in ("src_ip", "dst_ip"):
            try:
                ipaddress.IPv4Address(_need(r, key, w, str))
            except ipaddress.AddressValueError as e:
                raise SettingsError(f"traffic settings: {w}.{key}: {e}") from None
        _need(r, "next_hops", w, list)
    for i, p in enumerate(_need(doc, "source_ports", "settings", list)):
        w = f"source_ports[{i}]"
        port = p.get("udp_sport") if isinstance(p, dict) else None
        if port is not None and (not isinstance(port, int) or port not in PORTS):
            raise SettingsError(f"traffic settings: {w}.udp_sport: {port!r} is not a port of {PORTS.start}-"
                                f"{PORTS.stop - 1}")
        _need(p, "path", w, list)
        _need(p, "qp", w, int)
    return doc
