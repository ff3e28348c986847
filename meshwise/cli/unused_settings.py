"""Settings a user gave that change nothing in the run (a schedule without a pipeline, a
WSD option under cosine): one warning each before any rank starts.
"""

from __future__ import annotations

from meshwise.cli.train_flags import BY_FIELD
from meshwise.train.config import TrainConfig, flag_name
from meshwise.train.model_config import MOE_SETTINGS


def noop_warnings(cfg: TrainConfig, origins: dict[str, str]) -> list[str]:
    """Settings the user gave that change nothing in this layout."""
    p, d, o = cfg.parallel, cfg.data, cfg.optim
    found = []
    if p.pp == 1 and "schedule" in origins:
        found.append(f"--schedule {p.schedule} has no effect without a pipeline (--pp 1)")
    if cfg.runtime.dtype != "bf16" and "grad_reduce_dtype" in origins:
        found.append(
            "--grad-reduce-dtype has no effect without --dtype bf16: fp32 "
            "gradients are reduced in fp32"
        )
    comm_flags = [f for f in ("compress", "allreduce") if f in origins]
    if p.dp * p.cp == 1 and comm_flags:
        found.append(f"--{comm_flags[0]} has no effect with --dp 1: no gradient is reduced over dp")
    lossy = cfg.comm.compress.partition(":")[0] in ("topk", "powersgd")
    if not lossy and "compress_warmup_steps" in origins:
        found.append(
            "--compress-warmup-steps has no effect without --compress topk:FRACTION "
            "or powersgd:RANK"
        )
    if not cfg.comm.compress.startswith("topk") and "topk_ramp_steps" in origins:
        found.append("--topk-ramp-steps has no effect without --compress topk:FRACTION")
    if o.on_nan != "skip" and "max_skipped_steps" in origins:
        found.append("--max-skipped-steps has no effect without --on-nan skip")
    wsd_only = [f for f in ("decay_steps", "decay_shape") if f in origins]
    if o.lr_schedule != "wsd" and wsd_only:
        found.append(f"{flag_name(wsd_only[0])} has no effect without --lr-schedule wsd")
    if o.lr_schedule == "constant" and "min_lr_ratio" in origins:
        found.append("--min-lr-ratio has no effect with --lr-schedule constant")
    read = [f for f in ("text_field", "data_format", "skip_bad_records") if f in origins]
    if read and d.path is not None and str(d.path).endswith(".bin"):
        found.append(
            f"{flag_name(read[0])} has no effect on a .bin: its records were read "
            "when it was prepared"
        )
    if d.sample_tokens > d.seq_len:
        found.append(
            f"--sample-tokens {d.sample_tokens} exceeds --seq-len {d.seq_len}: past "
            f"that, each token sees only the last {d.seq_len} tokens"
        )
    for name in ("loss_on", "long_conversations", "chat_template"):
        if d.format != "chat" and name in origins and not str(d.path).endswith(".bin"):
            found.append(f"{BY_FIELD[name][0]} has no effect without --format chat")
    if d.eval_every == 0 and "eval_batches" in origins:
        found.append("--eval-batches applies to the one evaluation at the end (--eval-every 0)")
    moe_only = [f for f in MOE_SETTINGS if f != "n_experts" and f in origins]
    if moe_only and not cfg.model.resolved().n_experts:
        found.append(f"{BY_FIELD[moe_only[0]][0]} has no effect on a dense model (--n-experts 0)")
    return found
