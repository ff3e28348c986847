"""Long sequences: activation memory per rank under cp and sp, the longest sequence,
and the loss curves of every new layout against one process.

Every figure comes from ``meshwise train`` jobs run as a user runs them (the
CLI in a subprocess, gloo ranks of this machine), read from their metrics:

- ``memory``: each layout trains ``--model llama-small`` at ``--seq-len LONG``
  (8192) and at 64, batch 1; the activations a rank holds are the difference
  of the two runs' peak resident sets (``peak_rss_bytes``: the worst rank's
  ``VmHWM``, measured by the operating system, with ``MALLOC_MMAP_THRESHOLD_=
  65536`` so glibc returns freed memory), which removes what does not depend
  on the sequence (parameters, gradients, AdamW, start-up). Printed beside the
  prediction of the per-layer formula (``activation_bytes``);
- ``longest``: the per-rank memory of one rank at ``--seq-len LONG`` is the
  budget; the longest multiple of 1024 tokens that 4 cp ranks train within it
  (searched from 4 x LONG, up or down);
- ``parity``: ``--model llama-small`` for 20 steps on every new layout and the
  GPT at cp 2, the largest relative difference of the loss per step from one
  process (``meshwise train --dp 1``).

    python benchmarks/long_sequences.py memory [--long 8192]
    python benchmarks/long_sequences.py longest [--long 8192]
    python benchmarks/long_sequences.py parity [--steps 20]

Runs are long on 2 cores (a step at 8192 tokens takes 10-40 s); the last line
printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import print_json, rel_diff  # noqa: E402

MODEL = ["--model", "llama-small"]
MEMORY_LAYOUTS = {
    "cp1": ["--dp", "1"],
    "cp2": ["--cp", "2"],
    "cp4": ["--cp", "4"],
    "tp2": ["--tp", "2"],
    "tp2+sp": ["--tp", "2", "--sp"],
}
PARITY_LAYOUTS = {
    "cp2": MODEL + ["--cp", "2"],
    "cp4": MODEL + ["--cp", "4"],
    "tp2+sp": MODEL + ["--tp", "2", "--sp"],
    "cp2 x tp2+sp": MODEL + ["--cp", "2", "--tp", "2", "--sp"],
    "dp2 x cp2 zero3": MODEL + ["--dp", "2", "--cp", "2", "--zero", "3"],
    "cp2 x pp2": MODEL + ["--cp", "2", "--pp", "2"],
    "gpt cp2": ["--model", "small", "--cp", "2"],
}


def activation_bytes(
    tokens: int,
    layers: int,
    h: int,
    kv: int,
    heads: int,
    ffn: int,
    tp: int = 1,
    sp: bool = False,
    dtype_bytes: int = 4,
) -> int:
    """Bytes one rank keeps for the backward per Llama layer, summed over layers, for the
    ``tokens`` it holds (T / cp): Korthikanti et al. 2022's count (section 4) for
    this model, the attention kept as its output and log-sum-exp (flash and ring
    attention keep no (T, T) scores; their memory is O(T x block), transient).

    Between the tensor-parallel layers, replicated: each of the two RMSNorms keeps
    its input, normalised value and output (6h per token), divided by tp with
    sequence parallelism. Inside them, split by tp: rotated q, rotated k, v and
    the attention output (2h + 2kv), its log-sum-exp (heads), the SwiGLU's gate,
    up and product (3 ffn)."""
    replicated = 6 * h / (tp if sp else 1)
    split = (2 * h + 2 * kv + heads + 3 * ffn) / tp
    return int(tokens * layers * (replicated + split) * dtype_bytes)


def run_train(flags: list[str], workdir: Path, name: str, env: dict) -> list[dict]:
    metrics = workdir / f"{name}.jsonl"
    metrics.unlink(missing_ok=True)
    cmd = [sys.executable, "-m", "meshwise", "train", *flags, "--metrics", str(metrics), "-q"]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    return [json.loads(line) for line in metrics.read_text().splitlines()]


def memory_env() -> dict:
    path = os.environ.get("PYTHONPATH")
    env = dict(
        os.environ,
        PYTHONPATH=f"{ROOT}{os.pathsep}{path}" if path else str(ROOT),
        MALLOC_MMAP_THRESHOLD_="65536",
    )
    env.pop("MESHWISE_COMM_CHECK", None)  # gloo's own formulation is what is measured
    return env


def peak_rss(layout: list[str], seq_len: int, block: int, workdir: Path, name: str) -> int:
    flags = [
        *MODEL,
        *layout,
        "--seq-len",
        seq_len,
        "--block-size",
        block,
        "--batch-size",
        1,
        "--steps",
        1,
        "--eval-batches",
        1,
        "--warmup-steps",
        0,
    ]
    records = run_train([str(f) for f in flags], workdir, name, memory_env())
    return records[-1]["peak_rss_bytes"]


def memory(args, workdir: Path) -> dict:
    mib = 2.0**-20
    out = {}
    for name, layout in MEMORY_LAYOUTS.items():
        long = peak_rss(layout, args.long, args.long, workdir, f"{name}-long")
        short = peak_rss(layout, 64, args.long, workdir, f"{name}-64")
        cp = int(layout[layout.index("--cp") + 1]) if "--cp" in layout else 1
        tp = int(layout[layout.index("--tp") + 1]) if "--tp" in layout else 1
        formula = activation_bytes(args.long // cp, 6, 384, 128, 6, 1024, tp, "--sp" in layout)
        out[name] = {
            "peak_long_mib": long * mib,
            "peak_64_mib": short * mib,
            "activations_mib": (long - short) * mib,
            "formula_mib": formula * mib,
        }
        print(f"{name}: {out[name]}", file=sys.stderr)
    ratios = {"cp2/cp1": ("cp2", "cp1"), "cp4/cp1": ("cp4", "cp1"), "tp2+sp/tp2": ("tp2+sp", "tp2")}
    return {
        "seq_len": args.long,
        "layouts": out,
        "ratios": {
            k: out[a]["activations_mib"] / out[b]["activations_mib"] for k, (a, b) in ratios.items()
        },
        "formula_ratios": {
            k: out[a]["formula_mib"] / out[b]["formula_mib"] for k, (a, b) in ratios.items()
        },
    }


def longest(args, workdir: Path) -> dict:
    """From 4 x LONG tokens, 1024 at a time: up while 4 cp ranks stay within one rank's
    peak at LONG, else down until they do."""
    budget = peak_rss(["--dp", "1"], args.long, args.long, workdir, "one-rank")
    tried = {}

    def fits(seq_len: int) -> bool:
        peak = peak_rss(["--cp", "4"], seq_len, seq_len, workdir, f"cp4-{seq_len}")
        tried[seq_len] = peak * 2.0**-20
        print(
            f"cp4 at {seq_len}: {tried[seq_len]:.0f} MiB (budget {budget * 2.0**-20:.0f})",
            file=sys.stderr,
        )
        return peak <= budget

    seq_len = 4 * args.long
    if fits(seq_len):
        while fits(seq_len + 1024):
            seq_len += 1024
    else:
        seq_len -= 1024
        while seq_len > args.long and not fits(seq_len):
            seq_len -= 1024
    return {
        "budget_mib": budget * 2.0**-20,
        "one_rank_seq_len": args.long,
        "cp4_seq_len": seq_len,
        "cp4_tried_mib": tried,
    }


def parity(args, workdir: Path) -> dict:
    env = dict(os.environ, MESHWISE_COMM_CHECK="nccl")  # as CI runs them
    common = [
        "--seq-len",
        "128",
        "--batch-size",
        "8",
        "--steps",
        str(args.steps),
        "--warmup-steps",
        "2",
        "--lr",
        "1e-3",
    ]
    refs, out = {}, {}
    for name, flags in PARITY_LAYOUTS.items():
        model = flags[:2]
        key = model[1]
        if key not in refs:
            refs[key] = run_train([*model, *common, "--dp", "1"], workdir, f"ref-{key}", env)
        got = run_train([*flags, *common], workdir, name.replace(" ", "_"), env)
        out[name] = max(rel_diff(g["loss"], r["loss"]) for g, r in zip(got, refs[key], strict=True))
        print(f"{name}: max relative loss difference {out[name]:.2e}", file=sys.stderr)
    return {"steps": args.steps, "max_rel_loss_diff": out}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("memory", "longest", "parity"))
    parser.add_argument("--long", type=int, default=8192, help="the long --seq-len")
    parser.add_argument("--steps", type=int, default=20, help="parity: steps per run")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="long-sequences-"))
    summary = {"memory": memory, "longest": longest, "parity": parity}[args.what](args, workdir)
    print_json({"what": args.what, **summary})


if __name__ == "__main__":
    main()
