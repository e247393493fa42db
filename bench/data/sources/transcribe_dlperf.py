"""Transcribe DLPerf's Megatron-LM GPT tables (V100) into dlperf_megatron_v100.csv (run once; provenance).

Input: Megatron-LM/README.md of Oneflow-Inc/DLPerf (Apache-2.0), commit
c89430bac64f64caabb0445ff7eb80175641454c, as argv[1]: the test-case table (nodes, GPUs per node,
dp, tp, pp, micro-batch, global batch, hidden, heads, layers) and the results table (latency = ms
per iteration). Settings from the same commit's Megatron-LM/scripts/mutil_perf_pretrain_gpt_dp_mp_pp.sh:
seq 2048, --fp16, --checkpoint-activations, GPT-2 vocabulary (50257, padded by Megatron to a multiple
of 128 x tp)."""
import csv
import re
import sys

cases, lat = {}, {}
for line in open(sys.argv[1], encoding="utf-8"):
    cells = [c.strip() for c in line.split("|")]
    if len(cells) == 14 and cells[0] == "--" and cells[1] not in ("", "--"):
        cases[cells[1]] = [int(c) for c in cells[2:]]
    elif len(cells) == 6 and cells[0] == "--" and cells[1] not in ("", "--"):
        lat[cells[1]] = float(re.match(r"[\d.]+", cells[2]).group())
out = []
for name, (nodes, per, dp, tp, pp, mb, _mbdp, _acc, gb, h, a, L) in cases.items():
    padded = -(-50257 // (128 * tp)) * 128 * tp
    out.append(dict(model=name, hidden=h, heads=a, layers=L, ffn=4 * h, vocab=padded, seq=2048, global_batch=gb,
                    micro_batch=mb, gpus=nodes * per, dp=dp, tp=tp, pp=pp, zero=0, recompute="full",
                    sequence_parallel="false", dtype="fp16", gpu="v100-16gb", gpus_per_node=per, nics=1,
                    inter="infiniband-edr-100g", engine="megatron", attention="unfused",
                    measured_s=round(lat[name] / 1e3, 5), memory_gib="", memory_kind=""))
w = csv.DictWriter(sys.stdout, fieldnames=list(out[0]))
w.writeheader()
w.writerows(out)
