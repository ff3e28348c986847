"""What a run writes: each step's metrics (what every rank contributes, combined in one
collective, and the metrics line written from them; docs/flags.md lists its keys) and the
notes that close the run.
"""

from __future__ import annotations

import math

from meshwise.data.tokenizer import printable
from meshwise.train.metrics import RankValues


def step_record(
    trainer, step: int, lr: float, labelled: int, combined: dict, step_time_s: float
) -> dict:
    """The step's metrics line (docs/flags.md) from the values every rank combined."""
    record = {
        "step": step,
        "loss": combined["loss"] if labelled else None,  # no target, no loss: not 0
        "grad_norm": math.sqrt(combined["sq_norm"]),
        "lr": lr,
        "tokens": trainer.global_tokens,
        "labelled_tokens": labelled,
        "step_time_s": step_time_s,
        "tokens_per_s": trainer.global_tokens / step_time_s,
        "grad_sync_bytes": int(combined["grad_sync_bytes"]),
        "model_state_bytes": int(combined["model_state_bytes"]),
        "peak_rss_bytes": int(combined["peak_rss_bytes"]),
        "peak_mem_bytes": int(combined["peak_mem_bytes"]),
    }
    if trainer.cfg.data.data_order == "epochs":
        record.update(trainer.batches.source.epoch_position(step, trainer.cfg.data.batch_size))
    record.update(trainer.comm_stats.record(combined))
    trainer.observer.record(record)
    if trainer.cfg.parallel.zero == 3:
        # Transient: full parameters gathered at once (unit in use + prefetched).
        record["zero3_peak_gathered_bytes"] = int(combined["gathered"])
    return record


def step_values(trainer, loss_part, sq_norm, skip, grad_bytes: float) -> RankValues:
    """What the metrics need from every rank, combined in one collective."""
    values = RankValues(trainer.device)
    values.add("loss", loss_part if trainer.reports_loss else 0.0, "sum")
    values.add("sq_norm", sq_norm, "first")
    values.add("skip", skip, "max")
    values.add("grad_sync_bytes", grad_bytes, "sum")
    values.add("model_state_bytes", trainer.engine.state_bytes() + trainer.frozen_bytes, "max")
    values.add("peak_rss_bytes", trainer.memory.run_peak_rss_bytes(), "max")
    values.add("peak_mem_bytes", trainer.memory.step_peak_bytes(), "max")
    values.add("gathered", getattr(trainer.engine, "peak_gathered_bytes", 0), "max")  # ZeRO-3
    trainer.comm_stats.add_to(values)
    return values


def end_notes(trainer, val_loss: float | None, sample: tuple[str, str] | None) -> None:
    """The run's closing notes: the summary, what the observer measured, the data's
    packing, the sample."""
    trainer.metrics.note(trainer.metrics.summary(val_loss))
    trainer.metrics.note(trainer.observer.summary())
    if trainer.batches.source.summary():  # chat data: packing, and what it truncated
        trainer.metrics.note(f"data: {trainer.batches.source.summary()}")
    if sample is not None:
        prompt, continuation = sample
        trainer.metrics.note(
            f"sample (prompt in [brackets]):\n[{printable(prompt)}]{printable(continuation)}"
        )
