"""A user's own multi-branch nn.Module (`file.py:factory`, no plait markers): the layer cut
descends through ModuleList/Sequential containers and the modules holding them (plait.graph.
layer_cut), the capture's layer edges are the true data dependencies, and the runtime runs
plans over the finer layers equal to one process."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from plait.cli import main
from plait.graph.capture import CaptureError, capture, layer_assignment
from plait.graph.layer_cut import DEFAULT_GRANULARITY, LayerCutError, layer_cut
from plait.graph.zoo import load_model
from plait.ir.plan import Plan, StageSpec
from plait.runtime.partition import layer_modules, split_into_graph, split_into_stages

TOWERS = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, h):
        super().__init__()
        self.ln = nn.LayerNorm(h)
        self.ff = nn.Sequential(nn.Linear(h, 2 * h), nn.GELU(), nn.Linear(2 * h, h))

    def forward(self, x):
        return x + self.ff(self.ln(x))


class Tower(nn.Module):
    def __init__(self, h, n):
        super().__init__()
        self.proj = nn.Linear(h, h)
        self.blocks = nn.ModuleList(Block(h) for _ in range(n))

    def forward(self, x):
        h0 = self.proj(x)
        h = h0
        for i, block in enumerate(self.blocks):
            h = block(h)
            if i == 1:
                h = h + h0  # a skip connection across blocks: proj -> blocks.2
        return h


class Towers(nn.Module):
    """A stem, three towers (a projection and a ModuleList of blocks each), a head."""

    def __init__(self, d=8, h=8, n=4, towers=3, classes=5):
        super().__init__()
        self.stem = nn.Linear(d, h)
        self.towers = nn.ModuleList(Tower(h, n) for _ in range(towers))
        self.head = nn.Linear(towers * h, classes)

    def forward(self, x):
        x = x * 0.5  # glue on the input alone, read by the stem and by the last tower
        s = torch.tanh(self.stem(x))  # read by towers 0 and 1
        outs = [t(s) for t in self.towers[:-1]] + [self.towers[-1](x)]
        return self.head(torch.cat(outs, dim=-1))


def sample_batch(batch, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 8, generator=g)
    return (x.to(device),), torch.randint(0, 5, (batch,), generator=g).to(device)


def make():
    return Towers, sample_batch
'''

# A user's GPT: its blocks sit in one child ModuleList (`self.body`), not at the top level.
GPT = '''
import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.attn = nn.MultiheadAttention(h, heads, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(h, 4 * h), nn.GELU(), nn.Linear(4 * h, h))

    def forward(self, x):
        y = self.ln1(x)
        x = x + self.attn(y, y, y, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class UserGPT(nn.Module):
    def __init__(self, vocab=32, seq=6, h=16, heads=2, layers=8):
        super().__init__()
        self.tok = nn.Embedding(vocab, h)
        self.pos = nn.Embedding(seq, h)
        self.body = nn.ModuleList(Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.lm = nn.Linear(h, vocab)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.body:
            x = block(x)
        return self.lm(self.ln_f(x))


def sample_batch(batch, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 32, (batch, 7), generator=g)
    return (ids[:, :-1].to(device),), ids[:, 1:].to(device)


def make():
    return UserGPT, sample_batch
'''

# nanoGPT's layout (Karpathy): blocks in self.transformer.h inside a ModuleDict, an assert on the
# sequence length in forward, the embedding tied to the LM head.
NANO = '''
import torch
import torch.nn as nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, n_embd):
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, n_embd, n_head):
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = MLP(n_embd)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab=64, block_size=16, n_layer=6, n_head=2, n_embd=32):
        super().__init__()
        self.block_size = block_size
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            drop=nn.Dropout(0.0),
            h=nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)]),
            ln_f=nn.LayerNorm(n_embd),
        ))
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        assert t <= self.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


def sample_batch(batch, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (batch, 9), generator=g)
    return (ids[:, :-1].to(device),), ids[:, 1:].to(device)


def make():
    return GPT, sample_batch
'''


def _tower_layers(t: int, n: int = 4) -> list[str]:
    return [f"towers.{t}.proj"] + [f"towers.{t}.blocks.{i}" for i in range(n)]


def _tower_edges(t: int, n: int = 4) -> list[tuple[str, str]]:
    chain = _tower_layers(t, n)
    stem = [("stem", chain[0])] if t < 2 else []  # tower 2 reads the (scaled) model input
    return stem + list(zip(chain, chain[1:])) + [(chain[0], chain[3]), (chain[-1], "head")]


EXPECTED_LAYERS = ["stem"] + [n for t in range(3) for n in _tower_layers(t)] + ["head"]
EXPECTED_EDGES = sorted(e for t in range(3) for e in _tower_edges(t))


@pytest.fixture
def towers_file(tmp_path):
    path = tmp_path / "towers.py"
    path.write_text(TOWERS)
    return f"{path}:make"


@pytest.fixture
def gpt_file(tmp_path):
    path = tmp_path / "user_gpt.py"
    path.write_text(GPT)
    return f"{path}:make"


def test_inspect_shows_each_towers_blocks_as_a_chain_joined_at_the_head(towers_file, capsys) -> None:
    assert main(["inspect", towers_file, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [row["name"] for row in out["layers"]] == EXPECTED_LAYERS
    # exact: the stem's output feeds towers 0 and 1 (not tower 0 alone), the scaled input ties
    # nothing, the skip connection proj -> blocks.2 is an edge, the towers meet only in the head
    assert sorted(tuple(e) for e in out["layer_edges"]) == EXPECTED_EDGES
    assert ("towers.1.proj", "towers.1.blocks.2") in {tuple(e) for e in out["layer_edges"]}
    assert not out["is_chain"] and "capture_notes" not in out["config"]
    assert main(["inspect", towers_file]) == 0
    table = capsys.readouterr().out
    assert "towers.2.blocks.3" in table and "layer graph branches (20 edges)" in table
    assert "towers.0.proj, towers.0.blocks.1" in table  # inputs from: the skip connection


def test_the_cut_changes_no_cost_only_where_it_falls(towers_file) -> None:
    spec = load_model(towers_file)
    inputs, target = spec.sample_batch(2, device="meta")
    fine = capture(spec.build("meta"), inputs, name="towers", loss_fn=lambda o: spec.loss(o, target))
    coarse_model = spec.build("meta")
    coarse_model.plait_granularity = 1  # split only what nothing calls (the towers ModuleList)
    coarse = capture(coarse_model, inputs, name="towers", loss_fn=lambda o: spec.loss(o, target))
    assert coarse.layer_names == ["stem", "towers.0", "towers.1", "towers.2", "head"]
    assert sorted(coarse.layer_edges) == sorted([("stem", f"towers.{t}") for t in range(2)]
                                                + [(f"towers.{t}", "head") for t in range(3)])
    for key in ("param_count", "fwd_flops", "bwd_flops", "saved_bytes"):
        assert sum(getattr(x, key) for x in fine.layers) == pytest.approx(sum(getattr(x, key) for x in coarse.layers))
    assert sum(p.numel() for p in spec.build("meta").parameters()) == sum(x.param_count for x in fine.layers)


def test_blocks_stay_whole_until_the_granularity_asks_for_more(towers_file) -> None:
    model = load_model(towers_file).build("meta")
    # a block holds ~1/13 of the parameters: finer than 1/8, so not split by default ...
    assert DEFAULT_GRANULARITY == 8 and list(layer_assignment(model)) == EXPECTED_LAYERS
    # ... while a granularity of 32 splits each block: ln and ff (a Sequential), then ff's linears;
    # GELU (no parameters) runs as glue inside the layer that reads it
    fine = list(layer_cut(model, granularity=32).heads)
    assert fine[1:5] == ["towers.0.proj", "towers.0.blocks.0.ln", "towers.0.blocks.0.ff.0",
                         "towers.0.blocks.0.ff.2"]
    names = [n for n, _ in layer_modules(model)]
    assert names == EXPECTED_LAYERS  # the runtime lists the same layers as the capture


def test_user_gpt_blocks_in_a_child_module_list_are_layers(gpt_file) -> None:
    model = load_model(gpt_file).build()
    names = list(layer_assignment(model))
    assert names == ["tok", "pos"] + [f"body.{i}" for i in range(8)] + ["ln_f", "lm"]
    # an HF-style nesting (self.transformer.h, the head beside it) is cut the same way
    hf = _HFStyle(model)
    assert list(layer_assignment(hf)) == (["transformer.tok", "transformer.pos"]
                                          + [f"transformer.h.{i}" for i in range(8)] + ["transformer.ln_f", "lm_head"])


def test_nano_gpt_layout_is_cut_per_block_and_its_stages_run(tmp_path) -> None:
    path = tmp_path / "nano.py"
    path.write_text(NANO)
    spec = load_model(f"{path}:make")
    model = spec.build()
    names = list(layer_assignment(model))
    # the ModuleDict is never called: its entries are layers (drop has no parameters: glue);
    # the assert on a traced length is kept as torch._assert, not a tracing failure
    assert names == (["transformer.wte", "transformer.wpe"] + [f"transformer.h.{i}" for i in range(6)]
                     + ["transformer.ln_f", "lm_head"]) and not layer_cut(model).notes
    stages = split_into_stages(model, [3, 3, 2, 2])
    assert [s.layers for s in stages][1] == ["transformer.h.1", "transformer.h.2", "transformer.h.3"]
    (ids,), _ = spec.sample_batch(2)
    vals: dict[str, torch.Tensor] = {"idx": ids}
    for st in stages[:-1]:
        vals.update(zip(st.output_names, st.module(*(vals[n] for n in st.input_names))))
    y = stages[-1].module(*(vals[n] for n in stages[-1].input_names))
    torch.testing.assert_close(y, model(ids), rtol=0, atol=0)
    with pytest.raises(AssertionError, match=r"assert t <= self.block_size.*nano.py:\d+"):
        stages[0].module(torch.zeros(1, 17, dtype=torch.long))


class _Trunk(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.tok, self.pos, self.h, self.ln_f = model.tok, model.pos, model.body, model.ln_f

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for block in self.h:
            x = block(x)
        return self.ln_f(x)


class _HFStyle(nn.Module):
    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.transformer = _Trunk(model)
        self.lm_head = model.lm

    def forward(self, ids):
        return self.lm_head(self.transformer(ids))


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.tower = nn.Sequential(*(nn.Linear(4, 4) for _ in range(6)))
        self.head = nn.Linear(4, 2)
        self.data_dependent = False

    def forward(self, x):
        h = self.a(x)
        if h.shape[0] > 1:  # shape-dependent: fine on meta, but torch.fx cannot trace it
            h = -h
        if self.data_dependent and h.sum() > 0:  # value-dependent: no capture on meta either
            h = -h
        return self.head(self.tower(h))


class _Reused(nn.Module):
    """Each tower calls its `act` (which holds a parameter) after every block."""

    def __init__(self) -> None:
        super().__init__()
        self.towers = nn.ModuleList(nn.ModuleDict({"blocks": nn.ModuleList(nn.Linear(4, 4) for _ in range(4)),
                                                   "act": nn.PReLU()}) for _ in range(2))
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        outs = []
        for t in self.towers:
            h = x
            for b in t["blocks"]:
                h = t["act"](b(h))
            outs.append(h)
        return self.head(torch.cat(outs, -1))


def test_an_untraceable_forward_keeps_the_coarse_cut_with_a_note(capsys) -> None:
    model = _DataDependent()
    cut = layer_cut(model)
    assert list(cut.heads) == ["a", "tower", "head"]
    assert len(cut.notes) == 1 and "torch.fx cannot trace" in cut.notes[0]
    # Called with known inputs (capture records their shapes as `plait_inputs`), torch.fx takes
    # the shape-dependent branch for them (plait.graph.concrete_trace) and the tower is cut per block.
    g = capture(model, (torch.randn(2, 4),), name="dd")
    assert g.layer_names == ["a", *(f"tower.{i}" for i in range(6)), "head"]
    assert "capture_notes" not in g.config
    model.data_dependent = True  # a branch on a value: a clear error naming the op, the module and the line
    with pytest.raises(CaptureError, match=r"cannot capture op .*_local_scalar_dense.* in module '<root>' at "
                                           r".*test_user_models.py:\d+ \(`if self.data_dependent and h.sum"):
        capture(model, (torch.randn(2, 4),), name="dd")
    assert len(layer_cut(model).notes) == 1  # and torch.fx cannot trace that branch either


def test_a_module_that_runs_twice_is_not_a_layer_its_holder_stays_whole() -> None:
    model = _Reused()
    cut = layer_cut(model)
    # each tower's `act` holds a parameter and runs 4 times, between its blocks: no cut through the
    # towers gives every layer one run, so the coarse cut stays, and the note says why
    assert list(cut.heads) == ["towers", "head"]
    assert cut.notes == ("module 'towers' is one layer: its child 'towers.0.act' runs 4 times "
                         "(a layer runs exactly once)",)
    g = capture(model, (torch.randn(3, 4),), name="reused")
    assert sum(x.param_count for x in g.layers) == sum(p.numel() for p in model.parameters())


class _SharedTower(nn.Module):
    def __init__(self, shared: nn.Module | None = None) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
        self.mix = shared if shared is not None else nn.Linear(4, 4)

    def forward(self, h):
        h = self.mix(self.proj(h))
        for b in self.blocks:
            h = b(h)
        return h


class _SharedModule(nn.Module):
    """Tower 1 reuses tower 0's `mix` module: the two towers cannot be separate layers."""

    def __init__(self) -> None:
        super().__init__()
        t0 = _SharedTower()
        self.towers = nn.ModuleList([t0, _SharedTower(shared=t0.mix)])
        self.head = nn.Linear(8, 2)

    def forward(self, h):
        return self.head(torch.cat([t(h) for t in self.towers], -1))


def test_a_module_two_towers_share_keeps_them_one_layer() -> None:
    model = _SharedModule()
    cut = layer_cut(model)
    assert list(cut.heads) == ["towers", "head"]
    assert cut.notes == ("module 'towers' is one layer: its child 'towers.0' holds a module that "
                         "'towers.1' holds too",)
    g = capture(model, (torch.randn(2, 4),), name="shared")
    assert g.layer_names == ["towers", "head"] and g.layer_edges == [("towers", "head")]


def test_a_bad_granularity_is_named() -> None:
    model = _DataDependent()
    model.plait_granularity = 0
    with pytest.raises(LayerCutError, match="plait_granularity must be a positive integer"):
        layer_cut(model)


def test_stages_hold_nested_layers_and_part_of_a_module_list(towers_file) -> None:
    spec = load_model(towers_file)
    model = spec.build()
    t0 = _tower_layers(0)
    groups = [["stem", *t0[:2], *_tower_layers(1)], t0[2:], _tower_layers(2), ["head"]]
    stages = split_into_graph(model, groups, [(0, 1), (0, 3), (1, 3), (2, 3)])
    # the skip connection crosses the cut inside tower 0: proj's output travels with blocks.0's
    assert stages[1].recv == {0: ["towers_0_proj", "towers_0_blocks_0"]}
    # the scaled input is computed by both source stages; neither sends it
    assert stages[0].input_names == ["x"] and stages[2].input_names == ["x"]
    (x,), _ = spec.sample_batch(3)
    vals: dict[str, torch.Tensor] = {"x": x}
    for st in stages[:3]:
        vals.update(zip(st.output_names, st.module(*(vals[n] for n in st.input_names))))
    y = stages[3].module(*(vals[n] for n in stages[3].input_names))
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)


# ---------------------------------------------------------------------------------- distributed
STEPS = 2
SGD = {"name": "sgd"}


def _equal_to_one_process(model: str, plan) -> object:
    from plait.runtime.api import LaunchConfig, RecordsConfig, TrainingConfig, reference_run, run

    training = TrainingConfig(optimizer=SGD, lr=0.5)
    ref_losses, ref_params = reference_run(model, plan, STEPS, training=training)
    result = run(model, None, plan, steps=STEPS, training=training,
                 launch=LaunchConfig(timeout=120), records=RecordsConfig(return_params=True))
    assert result.losses == pytest.approx(ref_losses, rel=0, abs=1e-6)
    assert result.params is not None and set(result.params) == set(ref_params)
    for name, value in result.params.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-6, msg=name)
    return result


@pytest.mark.distributed
def test_tower_model_with_a_pipeline_cut_inside_a_tower_equals_one_process(towers_file) -> None:
    # Stage 1 holds blocks 1-3 of tower 0 (the skip connection from proj crosses the cut); stage 2,
    # tower 2, is a source beside stage 0: both compute the scaled input themselves.
    t0 = _tower_layers(0)
    groups = [["stem", *t0[:2], *_tower_layers(1)], t0[2:], _tower_layers(2), ["head"]]
    plan = Plan(stages=[StageSpec(name=f"s{i}", layers=g, devices=[i]) for i, g in enumerate(groups)],
                stage_edges=[(0, 1), (0, 3), (1, 3), (2, 3)], micro_batch=2, global_batch=8, dtype="fp32")
    result = _equal_to_one_process(towers_file, plan)
    assert [r.layers for r in result.ranks] == groups


@pytest.mark.distributed
def test_user_gpt_planned_with_pp4_by_plait_plan_runs_equal_to_one_process(gpt_file, capsys) -> None:
    assert main(["plan", "--family", "3d", "--model", gpt_file, "--cluster", "a100-80gb:nodes=1,gpus_per_node=4",
                 "--global-batch", "8", "--top", "100", "--finalists", "0", "--json", "--no-progress"]) == 0
    res = json.loads(capsys.readouterr().out)
    pp4 = [Plan.parse(row["plan_str"]) for row in res["top"]]
    pp4 = [p for p in pp4 if p.pp == 4 and p.schedule == "1f1b"]
    assert pp4, "the search found no pp=4 plan"
    best = pp4[0]
    plan = Plan.parse(f"pp=4,micro_batch={best.micro_batch},global_batch=8,schedule=1f1b,dtype=fp32")
    result = _equal_to_one_process(gpt_file, plan)
    layers = [name for r in result.ranks for name in r.layers]
    assert layers == ["tok", "pos"] + [f"body.{i}" for i in range(8)] + ["ln_f", "lm"]
    assert all(r.layers for r in result.ranks) and len(result.ranks) == 4


def test_towers_plan_family_graph_places_every_layer_once(towers_file, capsys) -> None:
    # Regression (issue 13): the towers branch one level deeper -- parallel(series(stem,
    # parallel(tower0, tower1)), tower2) -> head -- and the head handed to the nested branch was lost
    # (KeyError: 'head' in the partitioner).
    assert main(["plan", "--family", "graph", "--model", towers_file, "--cluster",
                 "a100-80gb:nodes=1,gpus_per_node=8", "--global-batch", "16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for row in res["top"]:
        plan = Plan.from_dict(row["plan"])
        assert sorted(n for s in plan.stages for n in s.layers) == sorted(EXPECTED_LAYERS)
