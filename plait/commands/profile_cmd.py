"""`plait profile`: measure N local workers or an (emulated) cluster and write a cluster YAML.

    plait profile --nprocs 4 --out local.yaml
    plait profile --cluster my-emulated-cluster.yaml --out measured.yaml --max-size 16M
    plait profile --model gpt:layers=2 --cluster C --micro-batches 1,2,4 --out gpt-profile.yaml

With `--model`, the model instead: each layer's forward and backward time at each micro-batch
of the sweep on every GPU kind of the cluster, through the layers `plait run` trains (one CPU
rank per kind on an emulated cluster, slowed by its kind's factor); the file is a model profile
(plait.ir.profile) that a cluster YAML names under `model_profiles:`.

With `--cluster` whose file asks for emulation, the workers of each node run inside
that node's network namespace (shaped with tc) and each rank's matmuls are stretched
by its GPU kind's slowdown, so the YAML describes the emulated cluster as it really
behaves -- the figures the simulator should be given to predict runs on it.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from plait.errors import check_output_path
from plait.measure.cluster_profile import (
    KiB,
    MiB,
    ProfileError,
    ProfileResult,
    kind_memory_bandwidth,
    parse_size,
    profile,
    result_to_yaml,
)

log = logging.getLogger("plait.profile")


def _sizes(text: str) -> list[int]:
    return [parse_size(x) for x in text.split(",") if x.strip()]


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "profile", help="measure links, collectives and matmul speed; write a cluster YAML",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    who = p.add_mutually_exclusive_group()
    who.add_argument("--nprocs", type=int, help="profile N local workers (one node)")
    who.add_argument("--cluster", help="cluster YAML or preset; emulated when its file says so")
    p.add_argument("--result", help="also save the raw measurements (JSON) here")
    p.add_argument("--from-result", metavar="JSON",
                   help="do not measure: turn a saved result (e.g. from workers you launched with your own "
                        "torchrun) into a cluster YAML; --cluster then gives the node layout")
    p.add_argument("--out", help="write the measured cluster YAML here (default: print it)")
    p.add_argument("--name", help="name of the measured cluster")
    p.add_argument("--sizes", type=_sizes, help="collective sizes, e.g. 1K,64K,4M (default 1K..--max-size, x2)")
    p.add_argument("--max-size", type=parse_size, default=256 * MiB, help="largest collective size (default 256M)")
    p.add_argument("--p2p-size", type=parse_size, default=4 * MiB, help="bytes per send/recv message (default 4M)")
    p.add_argument("--matmul-sizes", type=lambda t: [int(x) for x in t.split(",")],
                   help="square matmul sizes n (default 256,512,1024 on CPU; 2048,4096,8192 on GPU)")
    p.add_argument("--dtypes", type=lambda t: t.split(","), help="matmul dtypes (default fp32,bf16 / all on GPU)")
    p.add_argument("--slowdown-dtype", default=None,
                   help="dtype whose datasheet peaks set the emulated slowdown (default bf16)")
    p.add_argument("--min-time", type=float, default=0.05, help="seconds per measurement, at least")
    p.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    p.add_argument("--timeout", type=float, default=300.0, help="seconds before the workers are stopped")
    p.add_argument("--json", action="store_true", help="print the raw measurements as JSON")
    p.add_argument("--model", help="profile this model's layers per GPU kind instead (zoo spec or file.py:factory)")
    p.add_argument("--micro-batches", type=lambda t: [int(x) for x in t.split(",")], default=[1, 2, 4],
                   help="with --model: the micro-batch sweep (default 1,2,4; lookups interpolate between them)")
    p.add_argument("--dtype", default="fp32", help="with --model: the plan's dtype (default fp32, as CPU ranks run)")
    p.add_argument("--repeats", type=int, default=5, help="with --model: timed repetitions per layer (median)")
    p.set_defaults(func=run)


def _read_text(path: str, flag: str) -> str:
    """A UTF-8 input file's text, or a ProfileError naming the option, the file and why."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise ProfileError(f"{flag} {path}: not UTF-8 text (byte {exc.start}: {exc.reason})") from None
    except OSError as exc:
        raise ProfileError(f"{flag} {path}: cannot read ({exc.strerror or exc})") from None


def run(args: argparse.Namespace) -> int:
    import yaml

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    check_output_path(args.out, "--out")
    check_output_path(args.result, "--result")
    if args.model:
        return _profile_model(args)
    if args.from_result:
        result = ProfileResult.from_json(_read_text(args.from_result, "--from-result"), args.from_result)
        base = None
        if args.cluster:
            from plait.cluster import load_cluster

            base = load_cluster(args.cluster)
        data = result_to_yaml(result, base, name=args.name)
        if args.out:
            Path(args.out).write_text(yaml.safe_dump(data, sort_keys=False))
            print(f"wrote {args.out}")
        else:
            sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
        return 0
    if not args.nprocs and not args.cluster:
        raise ProfileError("plait profile: give --nprocs N, --cluster CLUSTER or --from-result JSON")
    result, data = profile(args.cluster, args.nprocs, sizes=args.sizes, max_size=args.max_size,
                           p2p_bytes=args.p2p_size, matmul_sizes=args.matmul_sizes, dtypes=args.dtypes,
                           slowdown_dtype=args.slowdown_dtype, min_time=args.min_time, backend=args.backend,
                           timeout_s=args.timeout, out=args.out, name=args.name)
    if args.result:
        Path(args.result).write_text(result.to_json())
    if args.json:
        print(json.dumps(json.loads(result.to_json()), indent=1))
        return 0
    _print_summary(result)
    if args.out:
        print(f"wrote {args.out}")
    else:
        sys.stdout.write(yaml.safe_dump(data, sort_keys=False))
    return 0


def _profile_model(args: argparse.Namespace) -> int:
    """`plait profile --model`: a model profile of every GPU kind of the cluster (issue 28)."""
    from plait.cluster import load_cluster
    from plait.ir.profile import profile_to_dict, save_profile
    from plait.measure.layer_profile import profile_model
    from plait.search import DEFAULT_CLUSTER

    cluster = load_cluster(args.cluster or DEFAULT_CLUSTER)

    def say(mb: int, cpu_s: float) -> None:
        print(f"  micro-batch {mb}: {cpu_s:.1f} s CPU", file=sys.stderr)

    prof, cpu_s = profile_model(args.model, cluster, args.micro_batches, args.dtype, repeats=args.repeats,
                                on_size=say)
    layers = len(prof.layer_names)
    print(f"plait profile --model {args.model}: {layers} layers x {len(args.micro_batches)} micro-batch sizes "
          f"({','.join(map(str, sorted(set(args.micro_batches))))}) x {args.repeats} repeats, {args.dtype}, "
          f"{cpu_s:.1f} s CPU; kinds: " + ", ".join(f"{k} (x{float(kp.meta['slowdown']):.3g})" for k, kp in prof.kinds.items()),
          file=sys.stderr)
    if args.out:
        save_profile(prof, args.out)
        print(f"wrote {args.out} (name it in the cluster YAML: model_profiles: [{args.out}])")
    else:
        import yaml

        sys.stdout.write(yaml.safe_dump(profile_to_dict(prof), sort_keys=False))
    return 0


def _print_summary(result: ProfileResult) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    t = Table(title=f"plait profile: {result.world} ranks, {result.backend}, {result.device_type}")
    for col in ("rank", "node", "fp32 GFLOP/s", "bf16 GFLOP/s", "slowdown", "memory BW GB/s", "copy GB/s"):
        t.add_column(col, justify="right")
    for r, m in enumerate(result.matmul):
        t.add_row(str(r), str(result.node_of[r]), f"{m.get('fp32', 0) / 1e9:.1f}", f"{m.get('bf16', 0) / 1e9:.1f}",
                  f"{result.slowdowns[r]:.2f}", f"{kind_memory_bandwidth(result, r) / 1e9:.2f}",
                  f"{result.memory_bandwidth[r] / 1e9:.1f}")
    console.print(t)
    # The YAML's `memory_bandwidth` is the "memory BW" column (plait.measure.cluster_profile.kind_memory_bandwidth): on a CPU
    # the elementwise-kernel rate, which is what memory-bound kernels achieve there, not the copy rate.
    console.print("memory BW: the rate memory-bound kernels achieve, written to the YAML as the kind's "
                  "memory_bandwidth" + (" (on CPU: elementwise kernels, below the copy rate)"
                                         if result.device_type == "cpu" and result.stream_bandwidth else ""))
    if result.p2p:
        t = Table(title="point-to-point (a -> b)")
        for col in ("pair", "MB/s", "latency us"):
            t.add_column(col, justify="right")
        for key, v in sorted(result.p2p.items(), key=lambda kv: tuple(map(int, kv[0].split("-")))):
            t.add_row(key, f"{v['bandwidth'] / 1e6:.1f}", f"{v['latency'] * 1e6:.0f}")
        console.print(t)
    t = Table(title="collectives (nccl-tests conventions)")
    for col in ("bytes", "all_reduce algbw MB/s", "busbw MB/s", "all_gather algbw MB/s", "busbw MB/s"):
        t.add_column(col, justify="right")
    for ar, ag in zip(result.collectives["all_reduce"], result.collectives["all_gather"], strict=True):
        size = ar["bytes"]
        label = f"{size // MiB}M" if size >= MiB else f"{size // KiB}K" if size >= KiB else str(size)
        t.add_row(label, f"{ar['algbw'] / 1e6:.1f}", f"{ar['busbw'] / 1e6:.1f}",
                  f"{ag['algbw'] / 1e6:.1f}", f"{ag['busbw'] / 1e6:.1f}")
    console.print(t)
