"""``meshwise plan`` beside published GPU runs, and the time a 1,024-GPU plan takes.

Each published run is planned with the layout it used (the model from Meta's
config.json, written to a temporary folder for ``--init-from``) and its
predicted tokens/s per GPU and MFU are printed beside the reported ones; part
of ``python benchmarks/planner.py`` (``--gpus-only`` for this part alone).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from meshwise.cli.main import build_parser
from meshwise.cli.plan import model_config
from meshwise.planner.layout import Layout
from meshwise.planner.plan import plan_request
from meshwise.planner.search import Space

LLAMA3 = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256,
          "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
          "tie_word_embeddings": False, "hidden_act": "silu"}
SIZES = {  # hidden, MLP, layers, heads, kv heads: Meta's config.json of each
    "8B": (4096, 14336, 32, 32, 8), "70B": (8192, 28672, 80, 64, 8),
    # 405B has 126 layers; meshwise cuts a pipeline into equal stages, so it is planned
    # with 128 (1.6% more FLOPs per token; MFU is compared, which that leaves alone)
    "405B": (16384, 53248, 128, 128, 8)}
PUBLISHED = [
    # (name, model, device, world, nodes, seq, batch, layout, published tokens/s per GPU,
    #  published MFU, source)
    ("torchtitan Llama 3 8B, FSDP2, 64 A100", "8B", "a100", 64, 8, 8192, 64,
     "--dp 64 --tp 1 --pp 1 --zero 3 --activation-checkpointing selective", 2973, 0.582,
     "torchtitan docs/performance.md: 64 A100 80GB, local batch 1, selective op AC"),
    ("torchtitan Llama 3 70B, FSDP2, 64 A100", "70B", "a100", 64, 8, 8192, 64,
     "--dp 64 --tp 1 --pp 1 --zero 3 --activation-checkpointing full", 331, 0.517,
     "torchtitan docs/performance.md: 64 A100 80GB, local batch 1, full AC"),
    ("Llama 3 405B, 8,192 H100, TP 8 PP 16 DP 64", "405B", "h100", 8192, 1024, 8192, 2048,
     None, None, 0.43,
     "Dubey et al. 2024, The Llama 3 Herd of Models, table 4: 430 TFLOP/s per GPU, BF16 MFU 43%"),
]


def published(tmp: Path) -> list[dict]:
    """Predictions for published runs on GPU clusters, each beside what was reported."""
    rows = []
    for name, size, device, world, nodes, seq, batch, flags, tps, mfu, source in PUBLISHED:
        hidden, mlp, layers, heads, kv = SIZES[size]
        folder = tmp / size
        folder.mkdir(exist_ok=True)
        (folder / "config.json").write_text(json.dumps({
            **LLAMA3, "hidden_size": hidden, "intermediate_size": mlp,
            "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": kv}))
        argv = ["plan", "--init-from", str(folder), "--seq-len", str(seq), "--batch-size",
                str(batch), "--device", device, "--world", str(world)]
        cfg = model_config(build_parser().parse_args(argv))
        if flags is None:  # the paper's axes; the planner picks schedule, micro-batches, ZeRO
            space = Space(axes={"dp": 64, "tp": 8, "pp": 16, "cp": 1})
            request = plan_request(cfg, world, device, space, nodes=nodes)
            p = request.run()[0]
        else:
            request = plan_request(cfg, world, device, Space(), nodes=nodes)
            p = request.predict(Layout.parse(flags))
        per_gpu = p.tokens_per_s / world
        row = {"name": name, "layout": p.layout.flags(), "pred_tokens_per_gpu": per_gpu,
               "pred_mfu": p.mfu, "published_tokens_per_gpu": tps, "published_mfu": mfu,
               "mfu_err": p.mfu / mfu - 1, "source": source, "pred_mem_gib": p.memory.total / 2**30}
        if tps:
            row["tokens_err"] = per_gpu / tps - 1
        rows.append(row)
        print(f"{name}: {p.layout.flags()}\n  predicted {per_gpu:,.0f} tokens/s per GPU, MFU "
              f"{100 * p.mfu:.1f}%, peak {row['pred_mem_gib']:.1f} GiB; published "
              + (f"{tps:,} tokens/s, " if tps else "") + f"MFU {100 * mfu:.1f}% "
              f"(error {100 * row['mfu_err']:+.1f}% in MFU); {source}", flush=True)
    return rows


def planning_time(tmp: Path) -> dict:
    """CPU and wall seconds to plan Llama 3 70B on 1,024 H100 (every valid layout)."""
    argv = ["plan", "--init-from", str(tmp / "70B"), "--seq-len", "8192", "--batch-size",
            "1024", "--device", "h100", "--world", "1024"]
    cfg = model_config(build_parser().parse_args(argv))
    wall, cpu = time.perf_counter(), time.process_time()
    found = plan_request(cfg, 1024, "h100", Space()).run()
    out = {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu,
           "layouts": len(found), "best": found[0].layout.flags()}
    print(f"planning Llama 3 70B on 1,024 H100: {out['layouts']} layouts fit, best "
          f"{out['best']}; {out['cpu_s']:.1f} s of CPU ({out['wall_s']:.1f} s wall)", flush=True)
    return out
