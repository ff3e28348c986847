"""One GPU: ``meshwise train`` on llama-1b shapes in bf16, beside two plain loops.

Three variants train the same shapes (``llama-1b``: 16 layers, d_model 2048, 32
heads, 8 key/value heads, SwiGLU 8192, tied head) with a 128k vocabulary
(``--vocab-size``, Llama 3's 128,256) on random token ids, at each of
``--seq-lens`` with ``--tokens-per-step`` tokens a step:

* ``meshwise``: ``meshwise train --model llama-1b --device cuda`` (``--dtype
  auto``: bf16 compute, fp32 master weights and AdamW state); its own metrics
  give tokens/s (the clock read after the step's one host read) and
  ``peak_mem_bytes`` (``torch.cuda.max_memory_allocated`` of the step);
* ``plain``: the same model (``meshwise.models.llama.Llama``, a plain module)
  in a loop a user would write: fp32 weights under ``torch.autocast(bfloat16)``,
  SDPA attention, ``torch.optim.AdamW(fused=True)``, gradient clipping;
* ``transformers``: ``LlamaForCausalLM`` (SDPA) in the same loop;
* ``meshwise-compile`` and ``plain-compile``: the first two with each decoder layer
  under ``torch.compile(fullgraph=True)`` (inductor): ``meshwise train --compile``,
  and the plain loop with ``layer.compile(fullgraph=True)`` on each of its layers.
  The first two steps pay the compile and fall within ``--warmup``.

The plain loops time each step from ``zero_grad`` to ``torch.cuda.synchronize()``
after ``optimizer.step()``; their loss is the cross entropy of the logits
against the next tokens (the same targets meshwise has; no second shift). Every
(variant, sequence length) is a process of its own, run ``--rounds`` times in
rotating order so a slow spell hits each alike; a run's figure is the median of
its steps after ``--warmup``, and the report gives the median over rounds.

FLOPs per token count every matmul forward and backward (6 per weight of the
layers and the head, not the embedding lookup) plus attention's score and value
products, 12 x layers x d_model x seq_len (the non-causal count that PaLM and
Megatron-LM report). MFU is that rate over the device's dense bf16 peak from
its data sheet. The last line is one JSON object (``skipped`` with the reason
where there is no CUDA device).

    python benchmarks/gpu.py [--seq-lens 2048,8192 --tokens-per-step 8192 --rounds 2]
    python benchmarks/gpu.py --only meshwise-compile --only plain-compile --only meshwise
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.common import print_json  # noqa: E402

VARIANTS = ("meshwise", "plain", "transformers", "meshwise-compile", "plain-compile")
# Each compiled variant is compared with its eager self and with the plain compiled loop.
PEERS = {"meshwise": ("plain", "transformers"), "meshwise-compile": ("plain-compile", "meshwise")}
SHAPE = dict(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_hidden_size=8192)
ROPE_THETA = 500000.0
# Dense bf16 peaks from the vendors' data sheets (SXM parts), in FLOP/s.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def flops_per_token(seq_len: int, vocab: int) -> float:
    d, f, layers = SHAPE["d_model"], SHAPE["ffn_hidden_size"], SHAPE["n_layer"]
    kv = d * SHAPE["n_kv_head"] // SHAPE["n_head"]
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * f  # q, k and v, o, gate, up and down
    matmul_params = layers * per_layer + vocab * d  # and the head
    return 6 * matmul_params + 12 * layers * d * seq_len


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


# ---------------------------------------------------------------- one run each
def run_meshwise(args, seq_len: int, batch: int, folder: Path, compiled: bool) -> dict:
    data, metrics = folder / "tokens.bin", folder / f"meshwise-{seq_len}.jsonl"
    if not data.exists():
        num_tokens = 4 * args.steps * args.tokens_per_step + 1
        ids = np.random.default_rng(0).integers(0, args.vocab_size, num_tokens)
        ids.astype(np.uint32).tofile(data)
    metrics.unlink(missing_ok=True)
    flags = [
        "train",
        "--model",
        "llama-1b",
        "--device",
        "cuda",
        "--dp",
        "1",
        "--data",
        str(data),
        "--token-dtype",
        "uint32",
        "--vocab-size",
        str(args.vocab_size),
        "--seq-len",
        str(seq_len),
        "--batch-size",
        str(batch),
        "--steps",
        str(args.steps),
        "--warmup-steps",
        "2",
        "--metrics",
        str(metrics),
        "--eval-batches",
        "1",
        "-q",
        *(["--compile"] if compiled else []),
    ]
    env = dict(os.environ, PYTHONPATH=str(ROOT), MESHWISE_CACHE=str(folder / "cache"))
    subprocess.run([sys.executable, "-m", "meshwise", *flags], check=True, env=env)
    records = [json.loads(line) for line in metrics.read_text().splitlines()][args.warmup :]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in records),
        "peak_mem_bytes": max(r["peak_mem_bytes"] for r in records),
    }


def _model(variant: str, vocab: int, seq_len: int) -> torch.nn.Module:
    if variant.startswith("plain"):
        from meshwise.models.llama import Llama, LlamaConfig

        cfg = LlamaConfig(
            **SHAPE,
            vocab_size=vocab,
            block_size=seq_len,
            rope_theta=ROPE_THETA,
            tie_embeddings=True,
        )
        return Llama(cfg)
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=SHAPE["d_model"],
        intermediate_size=SHAPE["ffn_hidden_size"],
        num_hidden_layers=SHAPE["n_layer"],
        num_attention_heads=SHAPE["n_head"],
        num_key_value_heads=SHAPE["n_kv_head"],
        tie_word_embeddings=True,
        max_position_embeddings=seq_len,
        rope_theta=ROPE_THETA,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def run_loop(variant: str, seq_len: int, batch: int, steps: int, warmup: int, vocab: int) -> dict:
    """The plain loop, in this process (a worker of its own)."""
    with torch.device("cuda"):
        model = _model(variant, vocab, seq_len)
    if variant == "plain-compile":
        for layer in model.layers.values():
            layer.compile(fullgraph=True)
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    gen = torch.Generator(device="cuda").manual_seed(0)
    rates, peaks = [], []
    for step in range(steps):
        ids = torch.randint(0, vocab, (batch, seq_len + 1), generator=gen, device="cuda")
        inputs, targets = ids[:, :-1], ids[:, 1:]
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(inputs)
            logits = out if torch.is_tensor(out) else out.logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch.cuda.synchronize()
        if step >= warmup:
            rates.append(batch * seq_len / (time.perf_counter() - start))
            peaks.append(torch.cuda.max_memory_allocated())
    return {"tokens_per_s": statistics.median(rates), "peak_mem_bytes": max(peaks)}


def run_worker(args, variant: str, seq_len: int, batch: int) -> dict:
    out = subprocess.run(
        [
            sys.executable,
            __file__,
            "--worker",
            variant,
            "--seq-lens",
            str(seq_len),
            "--batch-size",
            str(batch),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--vocab-size",
            str(args.vocab_size),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------- rounds and report
def summarise(runs: dict, seq_len: int, batch: int, vocab: int, peak: float | None) -> dict:
    per_token = flops_per_token(seq_len, vocab)
    row = {"batch_size": batch, "flops_per_token": per_token}
    for variant, results in runs.items():
        rate = statistics.median(r["tokens_per_s"] for r in results)
        tflops = rate * per_token / 1e12
        row[variant] = {
            "tokens_per_s": rate,
            "tflops": tflops,
            "mfu": tflops * 1e12 / peak if peak else None,
            "peak_mem_gib": max(r["peak_mem_bytes"] for r in results) / 2**30,
            "rounds": [round(r["tokens_per_s"]) for r in results],
        }
    for ours, peers in PEERS.items():
        for peer in peers:
            if ours in row and peer in row:
                rate = row[ours]["tokens_per_s"] / row[peer]["tokens_per_s"]
                row[f"{ours}_vs_{peer}"] = rate
    return row


def print_row(seq_len: int, row: dict) -> None:
    for variant in VARIANTS:
        if variant in row:
            r = row[variant]
            mfu = f", MFU {r['mfu']:.1%}" if r["mfu"] is not None else ""
            print(
                f"seq {seq_len}: {variant:<16} {r['tokens_per_s']:>9,.0f} tokens/s, "
                f"{r['tflops']:.0f} TFLOP/s{mfu}, peak {r['peak_mem_gib']:.1f} GiB",
                flush=True,
            )
    for ours, peers in PEERS.items():
        ratios = [f"{p} {row[f'{ours}_vs_{p}']:.2f}x" for p in peers if f"{ours}_vs_{p}" in row]
        if ratios:
            print(f"seq {seq_len}: {ours} tokens/s over " + ", ".join(ratios), flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-lens", default="2048,8192", help="comma-separated sequence lengths")
    p.add_argument(
        "--tokens-per-step",
        type=int,
        default=8192,
        help="tokens a step; the batch is this over the sequence length",
    )
    p.add_argument("--vocab-size", type=int, default=128256)
    p.add_argument("--steps", type=int, default=12, help="steps per run")
    p.add_argument("--warmup", type=int, default=4, help="steps left out of each run's median")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument(
        "--only",
        choices=VARIANTS,
        action="append",
        help="run this variant (repeat for several; default: all)",
    )
    p.add_argument(
        "--worker", choices=("plain", "transformers", "plain-compile"), help=argparse.SUPPRESS
    )
    p.add_argument("--batch-size", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print_json({"skipped": "no CUDA device: this benchmark needs one GPU"})
        return
    seq_lens = [int(s) for s in args.seq_lens.split(",")]
    if args.worker:
        print(
            json.dumps(
                run_loop(
                    args.worker,
                    seq_lens[0],
                    args.batch_size,
                    args.steps,
                    args.warmup,
                    args.vocab_size,
                )
            )
        )
        return
    variants = args.only or list(VARIANTS)
    peak, began = peak_flops(), time.perf_counter()
    summary = {
        "device": torch.cuda.get_device_name(),
        "vocab_size": args.vocab_size,
        "tokens_per_step": args.tokens_per_step,
        "rounds": args.rounds,
        "seq": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for seq_len in seq_lens:
            batch = max(1, args.tokens_per_step // seq_len)
            runs = {v: [] for v in variants}
            for round_ in range(args.rounds):
                shift = round_ % len(variants)
                for variant in variants[shift:] + variants[:shift]:
                    if variant.startswith("meshwise"):
                        compiled = variant.endswith("compile")
                        result = run_meshwise(args, seq_len, batch, Path(tmp), compiled)
                    else:
                        result = run_worker(args, variant, seq_len, batch)
                    runs[variant].append(result)
            row = summarise(runs, seq_len, batch, args.vocab_size, peak)
            print_row(seq_len, row)
            summary["seq"][str(seq_len)] = row
    summary["wall_s"] = time.perf_counter() - began
    print_json(summary)


if __name__ == "__main__":
    main()
