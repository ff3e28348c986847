"""One GPU: each attention call as meshwise runs it beside what ran before, time and memory.

Grouped-query causal attention at llama-1b's head shape (``--heads`` 32 query
heads, ``--kv-heads`` 8, head size 64) over ``--seq-len`` tokens, forward and
backward, in fp32 and bf16, for each kind of call:

* ``dense``: ``sdpa_gqa`` is ``F.scaled_dot_product_attention(enable_gqa=True)``
  with every backend allowed (in fp32 only the math backend serves it, which
  forms the (B, H, T, T) scores); ``meshwise`` is
  ``meshwise.models.attention_kernels.attention``'s choice;
* ``window`` (``--window`` tokens): SDPA with the boolean (T, T) mask beside
  meshwise's compiled ``flex_attention``;
* ``documents`` (``--mean-doc`` tokens on average): one SDPA per document
  (``documents_attention``, what the CPU runs) beside ``flex_attention``;
* ``dropout`` (p = 0.1): the weights formed whole beside tiles of keys.

Each figure is the median of ``--repeats`` calls after two warm-up calls (the
first compiles ``flex_attention``), timed with CUDA events; ``peak_MiB`` is
``torch.cuda.max_memory_allocated`` above the inputs during one call. The
last line is one JSON object (``skipped`` where there is no CUDA device).

    python benchmarks/attention_kernels.py [--seq-len 4096 --batch-size 2]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.common import print_json  # noqa: E402


def _forms(args, dtype):
    from meshwise.geometry.documents import Documents
    from meshwise.models.attention import ScaledDotProductAttention
    from meshwise.models.attention_kernels import attention, documents_attention
    from meshwise.models.attention_masks import DocumentMask, window_mask
    from meshwise.models.context import ForwardContext

    B, T = args.batch_size, args.seq_len
    rng = np.random.default_rng(0)
    lengths = []
    for _ in range(B):  # documents of about --mean-doc tokens, cut to fill the row
        row = np.maximum(rng.exponential(args.mean_doc, T), 1).astype(int)
        row = row[: np.searchsorted(np.cumsum(row), T) + 1]
        row[-1] = T - row[:-1].sum()
        lengths.append(row.tolist())
    ids = torch.tensor(np.stack([np.repeat(np.arange(len(r)), r) for r in lengths]), device="cuda")
    positions = torch.tensor(
        np.stack([np.concatenate([np.arange(n) for n in r]) for r in lengths]), device="cuda"
    )
    documents = DocumentMask(Documents(ids, positions), lengths)
    mask = window_mask(T, T, args.window, "cuda")
    context = ForwardContext(seed=0)
    dropout = ScaledDotProductAttention(0.1, "attn").train()
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def old_dropout(q, k, v):
        return dropout._with_dropout(q, k, v, True, context=context)

    return {
        "dense": {
            "sdpa_gqa": lambda q, k, v: sdpa(q, k, v, is_causal=True, enable_gqa=True),
            "meshwise": lambda q, k, v: attention(q, k, v),
        },
        "window": {
            "sdpa_mask": lambda q, k, v: sdpa(q, k, v, attn_mask=mask, enable_gqa=True),
            "meshwise": lambda q, k, v: attention(q, k, v, window=args.window),
        },
        "documents": {
            "per_document": lambda q, k, v: documents_attention(q, k, v, lengths),
            "meshwise": lambda q, k, v: attention(q, k, v, documents=documents),
        },
        "dropout": {
            "explicit": old_dropout,
            "meshwise": lambda q, k, v: attention(q, k, v, keep=dropout._keep(q, T, context)),
        },
    }


def _measure(fn, inputs, repeats: int) -> dict:
    q, k, v, dout = inputs

    def call():
        for t in (q, k, v):
            t.grad = None
        fn(q, k, v).backward(dout)

    for _ in range(2):
        call()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        call()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    call()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return {"ms": round(statistics.median(times), 2), "peak_MiB": round(peak / 2**20)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--window", type=int, default=1024)
    parser.add_argument("--mean-doc", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        summary = {"skipped": "no CUDA device"}
        print_json(summary)
        return summary
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    for dtype in (torch.float32, torch.bfloat16):
        g = torch.Generator(device="cuda").manual_seed(0)
        B, T, H, G = args.batch_size, args.seq_len, args.heads, args.kv_heads
        q, dout = (
            torch.randn(B, H, T, 64, generator=g, device="cuda", dtype=dtype) for _ in range(2)
        )
        k, v = (torch.randn(B, G, T, 64, generator=g, device="cuda", dtype=dtype) for _ in range(2))
        inputs = [q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), dout]
        for case, forms in _forms(args, dtype).items():
            for name, fn in forms.items():
                try:
                    got = _measure(fn, inputs, args.repeats)
                except torch.OutOfMemoryError:
                    got = {"error": "out of memory"}
                    torch.cuda.empty_cache()
                results[f"{str(dtype)[6:]}/{case}/{name}"] = got
                print(f"{str(dtype)[6:]:9} {case:10} {name:13} {got}", flush=True)
    print_json(results)
    return results


if __name__ == "__main__":
    main()
