"""One GPU: ``meshwise train`` on a 1B Llama in bf16 beside a plain PyTorch loop.

Two variants train the same shapes (``llama-1b``: 16 layers, d_model 2048, 32
heads, 8 key/value heads, SwiGLU 8192, tied head; vocabulary 32,000) on random
token ids at ``--seq-len`` (default 2048) and ``--batch-size`` sequences per
step, each in a process of its own:

* ``meshwise``: ``meshwise train --model llama-1b --device cuda --dtype bf16``
  (bf16 compute, fp32 master weights and AdamW state), tokens/s from its
  metrics (global tokens over each step's time, the clock read after the
  step's one device read);
* ``torch``: transformers' ``LlamaForCausalLM`` with SDPA attention, fp32
  weights under ``torch.autocast(bfloat16)``, ``torch.optim.AdamW(fused=True)``
  and the same gradient clipping; each step timed from ``zero_grad`` to after
  ``optimizer.step()`` with ``torch.cuda.synchronize()`` before the clock.

FLOPs per token count every matmul forward and backward (6 per parameter in a
matrix multiply: the layers' projections and the head, not the embedding
lookup) plus attention's score and value products, 12 x layers x d_model x
seq_len (the non-causal count, as PaLM and Megatron-LM report; a causal kernel
does about half of it). MFU is that rate over the device's dense bf16 peak.
The medians of the steps after ``--warmup`` are compared; the last line is one
JSON object (``skipped`` and the reason where there is no CUDA device).

    python benchmarks/gpu.py [--seq-len 2048 --batch-size 4 --steps 20 --warmup 5]
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from benchmarks.common import print_json  # noqa: E402

VOCAB = 32000
SHAPE = dict(n_layer=16, d_model=2048, n_head=32, n_kv_head=8, ffn_hidden_size=8192)
# Dense bf16 peaks from the vendors' data sheets (SXM parts), in FLOP/s.
PEAK_BF16 = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "L40S": 362e12, "A10G": 70e12}


def flops_per_token(seq_len: int) -> float:
    d, f, layers = SHAPE["d_model"], SHAPE["ffn_hidden_size"], SHAPE["n_layer"]
    kv = d * SHAPE["n_kv_head"] // SHAPE["n_head"]
    per_layer = d * d + 2 * d * kv + d * d + 3 * d * f  # q, k and v, o, gate, up and down
    matmul_params = layers * per_layer + VOCAB * d  # and the head
    return 6 * matmul_params + 12 * layers * d * seq_len


def peak_flops() -> float | None:
    name = torch.cuda.get_device_name()
    return next((peak for key, peak in PEAK_BF16.items() if key in name), None)


def _tokens(path: Path, num_tokens: int) -> None:
    ids = np.random.default_rng(0).integers(0, VOCAB, num_tokens).astype(np.uint16)
    ids.tofile(path)


def run_meshwise(args, folder: Path) -> list[float]:
    data, metrics = folder / "tokens.bin", folder / "meshwise.jsonl"
    _tokens(data, 4 * args.steps * args.batch_size * (args.seq_len + 1))
    flags = ["train", "--model", "llama-1b", "--device", "cuda", "--dtype", "bf16",
             "--dp", "1", "--data", str(data), "--vocab-size", str(VOCAB),
             "--seq-len", str(args.seq_len), "--batch-size", str(args.batch_size),
             "--steps", str(args.steps), "--warmup-steps", "2", "--metrics", str(metrics),
             "--eval-batches", "1", "-q"]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    subprocess.run([sys.executable, "-m", "meshwise", *flags], check=True, env=env)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    return [r["tokens_per_s"] for r in records[args.warmup:]]


def run_torch(args) -> list[float]:
    """The plain loop, in this process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=SHAPE["d_model"],
                         intermediate_size=SHAPE["ffn_hidden_size"],
                         num_hidden_layers=SHAPE["n_layer"], num_attention_heads=SHAPE["n_head"],
                         num_key_value_heads=SHAPE["n_kv_head"], tie_word_embeddings=True,
                         max_position_embeddings=args.seq_len, rope_theta=500000.0)
    model = LlamaForCausalLM(config).cuda()
    model.config._attn_implementation = "sdpa"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(0.9, 0.95),
                                  weight_decay=0.1, fused=True)
    gen = torch.Generator().manual_seed(0)
    tokens_per_step = args.batch_size * args.seq_len
    rates = []
    for step in range(args.steps):
        ids = torch.randint(0, VOCAB, (args.batch_size, args.seq_len + 1), generator=gen).cuda()
        torch.cuda.synchronize()
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        torch.cuda.synchronize()
        if step >= args.warmup:
            rates.append(tokens_per_step / (time.perf_counter() - start))
    return rates


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--only", choices=("meshwise", "torch"), help="run one variant")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print_json({"skipped": "no CUDA device: this benchmark needs one GPU"})
        return
    summary = {"device": torch.cuda.get_device_name(), "seq_len": args.seq_len,
               "batch_size": args.batch_size, "flops_per_token": flops_per_token(args.seq_len)}
    peak = peak_flops()
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"meshwise": lambda: run_meshwise(args, Path(tmp)),
                    "torch": lambda: run_torch(args)}
        for name, run in variants.items():
            if args.only in (None, name):
                rate = statistics.median(run())
                tflops = rate * summary["flops_per_token"] / 1e12
                summary[name] = {"tokens_per_s": rate, "tflops": tflops,
                                 "mfu": tflops * 1e12 / peak if peak else None}
                print(f"{name}: {rate:,.0f} tokens/s, {tflops:.1f} TFLOP/s"
                      + (f", MFU {summary[name]['mfu']:.1%}" if peak else ""), flush=True)
    if "meshwise" in summary and "torch" in summary:
        summary["meshwise_vs_torch_tokens_per_s"] = (summary["meshwise"]["tokens_per_s"]
                                                     / summary["torch"]["tokens_per_s"])
    print_json(summary)


if __name__ == "__main__":
    main()
