"""What document masking costs: SDPA with a mask beside a varlen loop, and whole steps.

Two measurements, on the same packed sequences (documents of random lengths,
``--mean-doc`` tokens on average):

* ``attention``: one attention layer's forward and backward (grouped-query
  heads as llama-small has them) in three forms: ``causal``, plain causal
  attention over the whole packed sequence (what runs without
  ``--document-mask``: attention across documents); ``sdpa_mask``,
  ``F.scaled_dot_product_attention`` with the additive block-diagonal causal
  mask (one kernel, all of the (T, T) work, the (B, T, T) mask made once per
  forward: what meshwise runs with dropout); ``varlen``, what meshwise runs
  otherwise (``meshwise.models.attention.documents_attention``): each document
  attended on its own, a causal SDPA per document on the tensors split along
  the sequence (what flash attention's varlen kernels do in one launch on a
  GPU), no work across documents, one kernel per document. Each form's median
  over ``--rounds`` (alternating order) and its ratio to ``causal``;
* ``step``: ``meshwise train``'s step on one process (``--model llama-small``,
  the trainer built as the CLI builds it), with and without
  ``--document-mask``, on a token file of those documents; and at ``--cp 2``,
  where the ring skips the key blocks whose documents its queries have left.

Times are CPU seconds of one thread (``time.process_time``; every rank runs on
one): on a machine shared with other work they measure the work done, where a
wall clock would measure the other jobs too.

The last line is one JSON object.

    python benchmarks/document_mask.py [--seq-len 1024 --batch-size 4 --mean-doc 128]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

from benchmarks.common import median, print_json, slowest, spawn  # noqa: E402

SEPARATOR = 0


def _documents_file(folder: Path, mean_doc: int, num_tokens: int = 400_000) -> str:
    """Tokens 1..255 in documents of about ``mean_doc`` tokens, each ended by id 0."""
    from meshwise.data.token_files import _write_meta

    rng = np.random.default_rng(0)
    lengths = np.maximum(rng.exponential(mean_doc, num_tokens // mean_doc), 1).astype(int)
    tokens = rng.integers(1, 256, int(lengths.sum()) + len(lengths)).astype(np.uint16)
    tokens[np.cumsum(lengths + 1) - 1] = SEPARATOR
    path = folder / "documents.bin"
    tokens.tofile(path)
    _write_meta(
        path,
        {
            "num_tokens": len(tokens),
            "vocab_size": 256,
            "max_token": None,
            "source": str(path),
            "dtype": "uint16",
            "tokenizer": {
                "kind": "tokenizer.json",
                "digest": "bench",
                "separator": [SEPARATOR],
                "end_of_text": SEPARATOR,
            },
        },
    )
    return str(path)


# ---------------------------------------------------------------- attention alone
def _attention_forms(batch: int, seq_len: int, mean_doc: int):
    from meshwise.data.packing import documents_from_starts
    from meshwise.models.attention import ScaledDotProductAttention
    from meshwise.models.attention_masks import DocumentMask
    from meshwise.models.context import ForwardContext

    g = torch.Generator().manual_seed(0)
    q, dout = (torch.randn(batch, 6, seq_len, 64, generator=g) for _ in range(2))
    k, v = (torch.randn(batch, 2, seq_len, 64, generator=g) for _ in range(2))
    for t in (q, k, v):
        t.requires_grad_()
    starts = np.random.default_rng(1).random((batch, seq_len)) < 1 / mean_doc
    documents = documents_from_starts(starts)
    masked = ScaledDotProductAttention()
    lengths = [np.unique(documents.ids[b], return_counts=True)[1].tolist() for b in range(batch)]

    def causal():
        F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(dout)

    def forward_context():  # a new forward's: its masks and lengths are made again
        return ForwardContext(documents=DocumentMask.of(documents, documents.to("cpu")))

    def sdpa_mask():
        mask = forward_context().documents.additive(seq_len, 0, q.dtype)
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True).backward(dout)

    def varlen():
        masked(q, k, v, context=forward_context()).backward(dout)

    return {"causal": causal, "sdpa_mask": sdpa_mask, "varlen": varlen}, sum(map(len, lengths))


def attention(args) -> dict:
    forms, num_docs = _attention_forms(args.batch_size, args.seq_len, args.mean_doc)
    times = {name: [] for name in forms}
    for round_ in range(args.rounds):
        for name in list(forms) if round_ % 2 == 0 else list(reversed(forms)):
            start = time.process_time()  # this thread's CPU time: steady on a shared machine
            forms[name]()
            times[name].append(time.process_time() - start)
    out = {name: median(ts[1:]) for name, ts in times.items()}  # the first round warms up
    mask_bytes = args.batch_size * args.seq_len**2 * 4
    return {
        "documents": num_docs,
        "ms": {n: round(t * 1e3, 1) for n, t in out.items()},
        "ratio_to_causal": {n: round(t / out["causal"], 2) for n, t in out.items()},
        "mask_MiB": round(mask_bytes / 2**20, 1),
    }


# ---------------------------------------------------------------- whole steps
def _steps(rank: int, argv: list[str], data_path: str, steps: int) -> list[float]:
    """Each step's CPU time on this rank (one thread: its compute, whatever else the
    machine runs; waiting for a peer is not counted)."""
    from meshwise.cli.main import build_parser
    from meshwise.cli.train import train_config
    from meshwise.train.trainer import Trainer

    cfg, _ = train_config(build_parser().parse_args(["train", *argv]))
    trainer = Trainer(cfg, data_path)
    times = []
    for step in range(1, steps + 1):
        start = time.process_time()
        trainer.train_step(step)
        times.append(time.process_time() - start)
    trainer.comm_stats.close()
    return times


def steps(args, data_path: str) -> dict:
    common = [
        "--model",
        "llama-small",
        "--seq-len",
        str(args.seq_len),
        "--block-size",
        str(args.seq_len),
        "--batch-size",
        str(args.batch_size),
        "--device",
        "cpu",
        "-q",
        "--data",
        data_path,
    ]
    out = {}
    for layout in (["--dp", "1"], ["--cp", "2"]):
        name = "cp2" if "--cp" in layout else "one_process"
        world = 2 if "--cp" in layout else 1
        runs = {}
        for round_ in range(args.rounds_steps):
            for mask in [False, True] if round_ % 2 == 0 else [True, False]:
                argv = common + layout + (["--document-mask"] if mask else [])
                per_rank = spawn(_steps, world, argv, data_path, args.steps)
                runs.setdefault(mask, []).extend(slowest(per_rank)[args.warmup :])
        plain, masked = median(runs[False]), median(runs[True])
        out[name] = {
            "step_s": round(plain, 3),
            "document_mask_step_s": round(masked, 3),
            "ratio": round(masked / plain, 3),
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--mean-doc", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=7, help="attention rounds")
    parser.add_argument("--rounds-steps", type=int, default=2, help="jobs per variant")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--skip-steps", action="store_true", help="attention only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    result = {
        "seq_len": args.seq_len,
        "batch_size": args.batch_size,
        "mean_doc": args.mean_doc,
        "attention": attention(args),
    }
    print(
        f"attention (fwd+bwd, {result['attention']['documents']} documents): "
        f"{result['attention']['ms']} ms; ratio to causal "
        f"{result['attention']['ratio_to_causal']}; mask {result['attention']['mask_MiB']} MiB"
    )
    if not args.skip_steps:
        with tempfile.TemporaryDirectory() as folder:
            result["step"] = steps(args, _documents_file(Path(folder), args.mean_doc))
        for name, row in result["step"].items():
            print(
                f"step ({name}): {row['step_s']} s without, {row['document_mask_step_s']} s "
                f"with --document-mask: {row['ratio']}x"
            )
    print_json(result)


if __name__ == "__main__":
    main()
