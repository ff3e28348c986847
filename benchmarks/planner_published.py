"""``meshwise plan`` beside published GPU runs, and the time a 1,024-GPU plan takes.

Each published run is planned with the layout it used (the model from Meta's
config.json, written to a temporary folder for ``--init-from``) on the profile of
the GPUs it ran on, and its predicted tokens/s per GPU is printed beside the
reported one; part of ``python benchmarks/planner.py`` (``--gpus-only`` for this
part alone). ``tests/unit/test_planner_published.py`` holds each prediction
within 20% of the run's figure, and not above it where the run was eager
PyTorch (``eager``): the planner predicts eager meshwise.

Where a run reports model TFLOP/s per GPU instead of tokens, its tokens/s are
that over the planner's own FLOPs per token (the same count its MFU uses).
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from meshwise.cli.main import build_parser
from meshwise.cli.plan import model_config
from meshwise.planner.layout import Layout
from meshwise.planner.request import plan_request
from meshwise.planner.search import Space

LLAMA3 = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}
SIZES = {  # hidden, MLP, layers, heads, kv heads: Meta's config.json of each
    "8B": (4096, 14336, 32, 32, 8),
    "70B": (8192, 28672, 80, 64, 8),
    "405B": (16384, 53248, 126, 128, 8),
    # meshwise cuts a pipeline into equal stages: under PP 16 405B is planned with 128
    # layers (1.6% more FLOPs per token, counted alike in the prediction and the figure)
    "405B-128": (16384, 53248, 128, 128, 8),
}
TORCHTITAN_2024 = (
    "https://github.com/pytorch/torchtitan/blob/"
    "6a6f755d2d7fd65ea6013324ae130306a0761e2c/docs/performance.md"
)
TORCHTITAN_H100 = (
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md"
)
LLAMA3_PAPER = "https://arxiv.org/abs/2407.21783"


@dataclass(frozen=True)
class PublishedRun:
    """One published training run, as ``meshwise plan`` can express it."""

    name: str
    model: str  # a key of SIZES, or "llama-1b" (meshwise's preset, vocabulary 32,000)
    device: str  # the profile of the GPUs it ran on
    world: int
    nodes: int
    seq_len: int
    batch_size: int  # global sequences per step
    layout: str  # meshwise train's flags
    figure: float  # tokens/s per GPU, or model TFLOP/s per GPU where ``tflops``
    source: str
    eager: bool = True  # eager PyTorch: the prediction may not exceed the figure
    tflops: bool = False


PUBLISHED = [
    # torchtitan, end of 2024: Grand Teton H100s (96 GB HBM2e, 500 W), FSDP2, eager, bf16,
    # local batch 2, selective op checkpointing (tables 1 and 3)
    PublishedRun(
        "torchtitan Llama 3.1 8B, 8 H100",
        "8B",
        "h100-hbm2e",
        8,
        1,
        8192,
        16,
        "--dp 8 --zero 3 --activation-checkpointing selective",
        5762,
        TORCHTITAN_H100 + " table 1",
    ),
    PublishedRun(
        "torchtitan Llama 3.1 8B, 128 H100",
        "8B",
        "h100-hbm2e",
        128,
        16,
        8192,
        256,
        "--dp 128 --zero 3 --activation-checkpointing selective",
        5605,
        TORCHTITAN_H100 + " table 3",
    ),
    # torchtitan, mid 2024: 405B on the same H100s, FSDP 16 x TP 8 (its TP plan shards the
    # norms over the sequence: --sp), local batch 2, full checkpointing, compile off; Llama
    # 3 8B and 70B on 64 A100 80GB, local batch 1
    PublishedRun(
        "torchtitan Llama 3.1 405B, 128 H100",
        "405B",
        "h100-hbm2e",
        128,
        16,
        8192,
        32,
        "--dp 16 --tp 8 --sp --zero 3 --activation-checkpointing full",
        109,
        TORCHTITAN_2024 + " (Llama 3.1 performance numbers)",
    ),
    PublishedRun(
        "torchtitan Llama 3 8B, 64 A100",
        "8B",
        "a100",
        64,
        8,
        8192,
        64,
        "--dp 64 --zero 3 --activation-checkpointing selective",
        2973,
        TORCHTITAN_2024 + " (Llama 3 performance numbers)",
    ),
    PublishedRun(
        "torchtitan Llama 3 70B, 64 A100",
        "70B",
        "a100",
        64,
        8,
        8192,
        64,
        "--dp 64 --zero 3 --activation-checkpointing full",
        331,
        TORCHTITAN_2024 + " (Llama 3 performance numbers)",
    ),
    # The Llama 3 paper's 405B pre-training (H100 SXM 80 GB, 700 W), table 4: 16M tokens
    # per step; interleaved 1F1B (section 3.3.2) with one sequence per micro-batch
    PublishedRun(
        "Llama 3 405B, 8,192 H100, TP 8 PP 16 DP 64",
        "405B-128",
        "h100",
        8192,
        1024,
        8192,
        2048,
        "--dp 64 --tp 8 --pp 16 --sp --schedule interleaved-1f1b "
        "--virtual-stages 4 --micro-batches 32 --zero 1",
        430,
        LLAMA3_PAPER + " table 4 (BF16 MFU 43%)",
        eager=False,
        tflops=True,
    ),
    PublishedRun(
        "Llama 3 405B, 16,384 H100, TP 8 PP 16 DP 128",
        "405B-128",
        "h100",
        16384,
        2048,
        8192,
        2048,
        "--dp 128 --tp 8 --pp 16 --sp --schedule interleaved-1f1b "
        "--virtual-stages 4 --micro-batches 16 --zero 1",
        400,
        LLAMA3_PAPER + " table 4 (BF16 MFU 41%)",
        eager=False,
        tflops=True,
    ),
    PublishedRun(
        "Llama 3 405B, 16,384 H100, TP 8 CP 16 PP 16 DP 8, 131,072 tokens",
        "405B-128",
        "h100",
        16384,
        2048,
        131072,
        128,
        "--dp 8 --cp 16 --tp 8 --pp 16 --sp --schedule interleaved-1f1b "
        "--virtual-stages 4 --micro-batches 16 --zero 1",
        380,
        LLAMA3_PAPER + " table 4 (BF16 MFU 38%)",
        eager=False,
        tflops=True,
    ),
    # One H200, this project's measurement: transformers' LlamaForCausalLM at llama-1b's
    # shapes (vocabulary 32,000, seq 2048, batch 4) in a plain loop, autocast bf16 over
    # fp32 weights, SDPA, clipping and AdamW(fused=True), the kernel meshwise's engine
    # runs (benchmarks/gpu.py of that time; meshwise's engine before the fused
    # optimizer ran 44,370 beside it)
    PublishedRun(
        "plain loop of llama-1b, 1 H200",
        "llama-1b",
        "h200",
        1,
        1,
        2048,
        4,
        "--dp 1",
        50421,
        "measured: a plain PyTorch loop, fused AdamW",
        eager=False,
    ),
]


def model_flags(model: str, tmp: Path) -> list[str]:
    """``meshwise plan``'s flags for ``model`` (a config.json written under ``tmp``)."""
    if model == "llama-1b":
        return ["--model", "llama-1b", "--vocab-size", "32000"]
    hidden, mlp, layers, heads, kv = SIZES[model]
    folder = tmp / model
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(
        json.dumps(
            {
                **LLAMA3,
                "hidden_size": hidden,
                "intermediate_size": mlp,
                "num_hidden_layers": layers,
                "num_attention_heads": heads,
                "num_key_value_heads": kv,
            }
        )
    )
    return ["--init-from", str(folder)]


def predict(run: PublishedRun, tmp: Path) -> dict:
    """The planner's tokens/s per GPU for ``run`` beside the run's own."""
    argv = [
        "plan",
        *model_flags(run.model, tmp),
        "--seq-len",
        str(run.seq_len),
        "--batch-size",
        str(run.batch_size),
        "--device",
        run.device,
        "--world",
        str(run.world),
    ]
    request = plan_request(
        model_config(build_parser().parse_args(argv)),
        run.world,
        run.device,
        Space(),
        nodes=run.nodes,
    )
    p = request.predict(Layout.parse(run.layout))
    published = run.figure
    if run.tflops:
        published = run.figure * 1e12 / request.shape.model_flops_per_token(run.seq_len)
    predicted = p.tokens_per_s / run.world
    return {
        "name": run.name,
        "device": run.device,
        "layout": p.layout.flags(),
        "pred_tokens_per_gpu": predicted,
        "published_tokens_per_gpu": published,
        "error": predicted / published - 1,
        "pred_mfu": p.mfu,
        "eager": run.eager,
        "pred_mem_gib": p.memory.total / 2**30,
        "source": run.source,
    }


def published(tmp: Path) -> list[dict]:
    """Predictions for published runs on GPU clusters, each beside what was reported."""
    rows = []
    for run in PUBLISHED:
        row = predict(run, tmp)
        rows.append(row)
        print(
            f"{row['name']} on {row['device']}: {row['layout']}\n  predicted "
            f"{row['pred_tokens_per_gpu']:,.0f} tokens/s per GPU (MFU "
            f"{100 * row['pred_mfu']:.1f}%, peak {row['pred_mem_gib']:.1f} GiB); published "
            f"{row['published_tokens_per_gpu']:,.0f} ({100 * row['error']:+.1f}%); "
            f"{row['source']}",
            flush=True,
        )
    return rows


def planning_time(tmp: Path) -> dict:
    """CPU and wall seconds to plan Llama 3 70B on 1,024 H100 (every valid layout)."""
    argv = [
        "plan",
        *model_flags("70B", tmp),
        "--seq-len",
        "8192",
        "--batch-size",
        "1024",
        "--device",
        "h100",
        "--world",
        "1024",
    ]
    cfg = model_config(build_parser().parse_args(argv))
    wall, cpu = time.perf_counter(), time.process_time()
    found = plan_request(cfg, 1024, "h100", Space()).run()
    out = {
        "wall_s": time.perf_counter() - wall,
        "cpu_s": time.process_time() - cpu,
        "layouts": len(found),
        "best": found[0].layout.flags(),
    }
    print(
        f"planning Llama 3 70B on 1,024 H100: {out['layouts']} layouts fit, best "
        f"{out['best']}; {out['cpu_s']:.1f} s of CPU ({out['wall_s']:.1f} s wall)",
        flush=True,
    )
    return out
