"""LoRA and QLoRA beside full fine-tuning and beside PEFT, one process each, on the same
Hugging Face Llama (random, saved here) and the same batches: median step time, the model
state meshwise counts (frozen weights + adapters' parameters, gradients and AdamW state),
and the process's peak RSS, measured by the process.

    python benchmarks/lora.py [--model llama-small --n-layer N --rank 8 --steps 12 --seq-len 256]
    python benchmarks/lora.py --dp 2 --n-layer 12 --vocab-size 4096  # ZeRO-2 and ZeRO-3

Each variant runs in a fresh process (``meshwise train --dp 1`` or a PEFT + transformers
+ ``torch.optim.AdamW`` loop), with ``MALLOC_MMAP_THRESHOLD_=65536`` so that glibc returns
freed buffers. The formula beside the counts: full fine-tuning 16 B/param (fp32 weights,
gradients, two AdamW moments); LoRA 4 B per frozen parameter + 16 B per adapter parameter;
QLoRA the same with the blocks' linear weights at 0.5 B + 4 B / 64 (a code and its share
of an fp32 block scale). The QLoRA run's frozen linear weights, measured: the LoRA run's 4 B
per linear parameter less the fall of peak RSS from LoRA to QLoRA, per linear parameter.
With ``--dp N``, full fine-tuning and LoRA run instead at ``--dp N --zero 2`` (LoRA's
frozen weights whole on every rank) and ``--dp N --zero 3`` (frozen weights sharded,
4 B / N per parameter, gathered a unit at a time), ``--repeats`` times each in rounds
whose order is reversed every other round (so that drift in the machine's speed hits
all alike): each row's step time the median over its runs' timed steps, beside LoRA's
over full fine-tuning's at that layout, and the CPU time of a step, all ranks together
(a whole run's less that of a run of the untimed steps alone, its processes' user and
system time: the work, which other work on a shared machine stretches less than the
step's wall-clock time); its peak RSS the largest over its ranks (the
median over its runs), and also the peak within a step (``peak_mem_bytes``), past
start-up's reading of the weights.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
from functools import partial
from pathlib import Path

# Runnable from a checkout without installing.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import run_rounds  # noqa: E402
from meshwise.train.model_config import MODEL_PRESETS  # noqa: E402

TARGETS = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama-small", help="a Llama preset's sizes")
    p.add_argument("--n-layer", type=int, default=0, help="blocks (0: the preset's)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="steps per variant (the first 2 untimed)")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--vocab-size", type=int, default=32000, help="the HF model's vocabulary")
    p.add_argument(
        "--dp", type=int, default=1, help="above 1: full and LoRA at ZeRO-2 and ZeRO-3 only"
    )
    p.add_argument("--repeats", type=int, default=2, help="with --dp: runs of each variant")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="also ZeRO-3's unit size cap")
    return p.parse_args(argv)


def sizes(args) -> dict:
    """The preset's sizes, with ``--n-layer``."""
    s = dict(MODEL_PRESETS[args.model])
    s["n_layer"] = args.n_layer or s["n_layer"]
    return s


def save_base(args, out: Path) -> None:
    """A random ``LlamaForCausalLM`` of the preset's sizes."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    s = sizes(args)
    config = LlamaConfig(
        hidden_size=s["d_model"],
        intermediate_size=s["ffn_hidden_size"],
        num_hidden_layers=s["n_layer"],
        num_attention_heads=s["n_head"],
        num_key_value_heads=s["n_kv_head"],
        vocab_size=args.vocab_size,
        max_position_embeddings=max(s["block_size"], args.seq_len),
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(out)


def meshwise_run(
    args,
    base: Path,
    tokens: Path,
    work: Path,
    variant: str,
    dp: int = 1,
    zero: int = 0,
    steps: int | None = None,
) -> dict:
    """``variant``: full, lora or qlora (LoRA with --quantize-base nf4); ``cpu_s``: the
    CPU seconds of the run's processes (start-up included), and with more than 2
    ``steps`` (default ``--steps``) the timed steps' figures."""
    metrics = work / f"metrics-{variant}-{dp}-{zero}.jsonl"
    metrics.unlink(missing_ok=True)  # a repeat writes its own
    cmd = [sys.executable, "-m", "meshwise", "train", "--init-from", str(base)]
    cmd += ["--data", str(tokens), "--vocab-size", str(args.vocab_size)]
    cmd += ["--dp", str(dp), "--zero", str(zero)]
    cmd += ["--steps", str(steps or args.steps), "--seq-len", str(args.seq_len)]
    cmd += ["--batch-size", str(args.batch_size), "--metrics", str(metrics), "-q"]
    cmd += ["--bucket-mb", str(args.bucket_mb)]
    if variant != "full":
        cmd += ["--lora-rank", str(args.rank), "--lora-alpha", str(2 * args.rank)]
        cmd += ["--lora-targets", TARGETS]
    if variant == "qlora":
        cmd += ["--quantize-base", "nf4"]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, check=True, env=_env())
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu_s = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if len(rows) <= 2:
        return {"cpu_s": cpu_s}
    return {
        "cpu_s": cpu_s,
        "step_times_s": [r["step_time_s"] for r in rows[2:]],
        "step_time_s": statistics.median(r["step_time_s"] for r in rows[2:]),
        "model_state_bytes_counted": rows[-1]["model_state_bytes"],
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in rows),
        # the steps' own peak (VmHWM reset each step), start-up's reading of the weights apart
        "step_peak_rss_bytes": max(r["peak_mem_bytes"] for r in rows[1:]),
    }


def dp_runs(args, base: Path, tokens: Path, work: Path) -> dict:
    """Full fine-tuning and LoRA at ``--dp N`` with ZeRO-2 and ZeRO-3, ``--repeats``
    rounds of the four runs, each row pooled over its rounds; then a round of runs of
    the 2 untimed steps only, whose CPU time taken from a whole run's leaves the timed
    steps' (all ranks' CPU seconds: the work done, which other work on a shared machine
    stretches less than the wall-clock time)."""
    names = [f"{variant} dp{args.dp} zero{zero}" for zero in (2, 3) for variant in ("full", "lora")]
    runs: dict[str, list[dict]] = {name: [] for name in names}
    start_up: dict[str, float] = {}

    def run(name: str, round_: int, i: int, steps: int | None = None) -> None:
        variant, _, zero = name.split()
        row = meshwise_run(
            args, base, tokens, work, variant, dp=args.dp, zero=int(zero[4:]), steps=steps
        )
        if steps is None:
            runs[name].append(row)
        else:
            start_up[name] = row["cpu_s"]

    run_rounds(names, args.repeats, 1, run)
    run_rounds(names, 1, 1, partial(run, steps=2))
    return {
        name: {
            "step_time_s": statistics.median(t for row in rows for t in row["step_times_s"]),
            "step_cpu_s": (statistics.median(row["cpu_s"] for row in rows) - start_up[name])
            / (args.steps - 2),
            "model_state_bytes_counted": rows[-1]["model_state_bytes_counted"],
            **{
                key: statistics.median(row[key] for row in rows)
                for key in ("peak_rss_bytes", "step_peak_rss_bytes")
            },
            "run_step_times_s": [row["step_time_s"] for row in rows],
        }
        for name, rows in runs.items()
    }


PEFT_LOOP = """
import json, resource, statistics, sys, time
import numpy as np, torch, torch.nn.functional as F
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM
base, tokens, rank, steps, seq, batch, targets = sys.argv[1:8]
rank, steps, seq, batch = int(rank), int(steps), int(seq), int(batch)
torch.set_num_threads(int(sys.argv[8]))
model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank,
                                         target_modules=targets.split(",")))
trainable = [p for p in model.parameters() if p.requires_grad]
opt = torch.optim.AdamW(trainable, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.0)
data = torch.from_numpy(np.fromfile(tokens, dtype=np.uint16).astype(np.int64))
gen = torch.Generator().manual_seed(0)
times = []
for step in range(steps):
    starts = torch.randint(0, len(data) - seq - 1, (batch,), generator=gen)
    rows = torch.stack([data[s : s + seq + 1] for s in starts.tolist()])  # (B, T + 1)
    t0 = time.perf_counter()
    logits = model(input_ids=rows[:, :-1]).logits
    loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(trainable, 1.0)
    opt.step()
    times.append(time.perf_counter() - t0)
rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
print(json.dumps({"step_time_s": statistics.median(times[2:]), "peak_rss_bytes": rss}))
"""


def peft_run(args, base: Path, tokens: Path) -> dict:
    argv = [str(base), str(tokens), str(args.rank), str(args.steps), str(args.seq_len)]
    argv += [str(args.batch_size), TARGETS, str(os.cpu_count() or 1)]
    out = subprocess.run(
        [sys.executable, "-c", PEFT_LOOP, *argv],
        check=True,
        env=_env(),
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _env() -> dict:
    return {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}


def counts(args) -> dict:
    """Parameters of the model and of its rank-r adapters on every targeted layer."""
    s = sizes(args)
    d, f, layers = s["d_model"], s["ffn_hidden_size"], s["n_layer"]
    kv = d // s["n_head"] * s["n_kv_head"]
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]  # (in, out)
    adapters = layers * sum(args.rank * (i + o) for i, o in shapes)
    linear = layers * sum(i * o for i, o in shapes)
    params = linear + layers * 2 * d + d + 2 * args.vocab_size * d
    return {"params": params, "linear_params": linear, "adapter_params": adapters}


def main(argv=None) -> None:
    import numpy as np

    args = parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        save_base(args, work / "base")
        tokens = work / "tokens.bin"
        rng = np.random.default_rng(0)
        rng.integers(0, args.vocab_size, 400_000).astype(np.uint16).tofile(tokens)
        if args.dp > 1:
            results = dp_runs(args, work / "base", tokens, work)
        else:
            results = {
                variant: meshwise_run(args, work / "base", tokens, work, variant)
                for variant in ("full", "lora", "qlora")
            }
            results["peft"] = peft_run(args, work / "base", tokens)
    n, dp = counts(args), args.dp
    nf4_bytes_per_param = 0.5 + 4 / 64
    formula = {
        "full": 16 * n["params"],
        "lora": 4 * (n["params"]) + 16 * n["adapter_params"],
        "qlora": 4 * (n["params"] - n["linear_params"])
        + nf4_bytes_per_param * n["linear_params"]
        + 16 * n["adapter_params"],
        # ZeRO-2: frozen weights and the adapters' values whole, the adapters' gradient
        # and moments sharded; ZeRO-3: all of it sharded
        f"lora dp{dp} zero2": 4 * n["params"] + (4 + 12 / dp) * n["adapter_params"],
        f"lora dp{dp} zero3": (4 * n["params"] + 16 * n["adapter_params"]) / dp,
        f"full dp{dp} zero2": (4 + 12 / dp) * n["params"],
        f"full dp{dp} zero3": 16 * n["params"] / dp,
    }
    for name, row in results.items():
        print(
            f"{name:15s} step {row['step_time_s'] * 1e3:8.1f} ms"
            + (f" (CPU {row['step_cpu_s'] * 1e3:6.1f} ms)" if "step_cpu_s" in row else "")
            + f"  peak RSS "
            f"{row['peak_rss_bytes'] / 2**20:8.1f} MiB"
            + (
                f" (in a step {row['step_peak_rss_bytes'] / 2**20:7.1f} MiB)"
                if "step_peak_rss_bytes" in row
                else ""
            )
            + (
                f"  model state {row['model_state_bytes_counted'] / 2**20:7.1f} MiB counted"
                f" (formula {formula[name] / 2**20:7.1f} MiB)"
                if name in formula
                else ""
            )
        )
    if "qlora" not in results:
        ratios = {
            f"zero{zero} {key}": results[f"lora dp{dp} zero{zero}"][key]
            / results[f"full dp{dp} zero{zero}"][key]
            for zero in (2, 3)
            for key in ("step_time_s", "step_cpu_s")
        }
        for zero in (2, 3):
            time, cpu = (ratios[f"zero{zero} {key}"] for key in ("step_time_s", "step_cpu_s"))
            print(
                f"LoRA / full at --dp {dp} --zero {zero}: step time {time:.3f}, "
                f"CPU time a step (all ranks) {cpu:.3f}"
            )
        print(json.dumps({**n, "formula_bytes": formula, "lora_over_full": ratios, **results}))
        return
    fall = results["lora"]["peak_rss_bytes"] - results["qlora"]["peak_rss_bytes"]
    measured = 4 - fall / n["linear_params"]
    print(
        f"QLoRA's frozen linear weights: {measured:.3f} B/param measured (4 B less the fall "
        f"of peak RSS, {fall / 2**20:.1f} MiB, over {n['linear_params'] / 1e6:.2f}M linear "
        f"parameters); formula {nf4_bytes_per_param:.4f} B/param"
    )
    print(
        json.dumps(
            {**n, "formula_bytes": formula, "qlora_linear_bytes_per_param": measured, **results}
        )
    )


if __name__ == "__main__":
    main()
