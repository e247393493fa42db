"""Transcribe llm-foundry's MPT benchmark tables into llmfoundry_mpt.csv (run once; kept for provenance).

Input: scripts/train/benchmarking/README.md of mosaicml/llm-foundry (Apache-2.0), commit
8c8dd48f72168c5d51e2f7b151595892a8fba43d; pass its path as argv[1]. Model dimensions from the
same commit's scripts/train/yamls/pretrain/mpt-<size>.yaml (vocab 50368, expansion 4).
Only bf16 sections are kept (plait has no fp8)."""
import csv
import sys

DIMS = {"125m": (768, 12, 12), "350m": (1024, 16, 24), "760m": (1536, 12, 24), "1b": (2048, 16, 24),
        "3b": (2560, 20, 32), "7b": (4096, 32, 32), "13b": (5120, 40, 40), "30b": (7168, 56, 48),
        "70b": (8192, 64, 80)}
SECTIONS = {"H100 80GB BF16 (Large Scale": ("h100-80gb", "infiniband"), "H100 80GB BF16": ("h100-80gb", "infiniband"),
            "A100 80GB with 1600": ("a100-80gb", "roce-1600gbps"), "A100 40GB with 1600": ("a100-40gb", "roce-1600gbps")}
out = []
section = None
for line in open(sys.argv[1], encoding="utf-8"):
    if line.startswith("## "):
        section = next((v for k, v in SECTIONS.items() if line[3:].startswith(k)), None)
        continue
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if section is None or len(cells) < 20 or cells[0] in ("Model", "---") or cells[14] not in ("amp_bf16", "bf16"):
        continue
    h, a, L = DIMS[cells[0]]
    seq, gpus, mb, ga, gb = int(cells[1]), int(cells[2]), int(cells[7]), int(cells[8]), int(cells[9])
    tok_s = float(cells[11])
    out.append(dict(model=f"mpt-{cells[0]}", hidden=h, heads=a, layers=L, ffn=4 * h, vocab=50368, seq=seq,
                    global_batch=gb, micro_batch=mb, grad_accum=ga, gpus=gpus, dp=gpus, tp=1, pp=1, zero=3,
                    recompute="full" if cells[17] == "True" else "none", dtype="bf16", gpu=section[0],
                    gpus_per_node=8, inter=section[1], engine="eager-fsdp", attention="flash",
                    measured_s=gb * seq / tok_s, measured_tok_s=tok_s, mfu=float(cells[4]),
                    memory_gib="", memory_kind="", precision=cells[14], mp_mode=cells[15]))
w = csv.DictWriter(sys.stdout, fieldnames=list(out[0]))
w.writeheader()
w.writerows(out)
