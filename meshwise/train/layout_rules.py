"""Which layouts train: the rules that tie the parallel axes, the pipeline schedule,
the sequence and the batch together, and the table of supported compositions.

``TrainConfig.validate`` runs them before any rank starts, and the layout planner
(``meshwise.planner``) keeps only the layouts they accept, so both share one
source of truth. Each rule raises ``ValueError`` with a one-line message naming
the bad value and what would be valid.
"""

from __future__ import annotations

from meshwise.models.families import family
from meshwise.pipeline.schedules import validate_schedule_config

ZERO_STAGES = (0, 1, 2, 3)


def check_layout(cfg, own_model: bool = False) -> None:
    """The axes, the schedule and the batch of ``cfg`` (a ``TrainConfig``) fit together,
    or ``ValueError`` names the first that does not; ``own_model``: the model's sizes
    are checked by ``parallelize`` instead."""
    p, m, d = cfg.parallel, cfg.model.resolved(), cfg.data
    if p.tp > 1 and not own_model:
        fam = family(cfg.model.family)
        fam.check_tp(fam.make_config(cfg.model.sizes(max(m.vocab_size, 1))), p.tp)
    if p.pp == 1:
        if p.virtual_stages != 1:
            raise ValueError(f"--virtual-stages {p.virtual_stages} needs --pp > 1")
        if p.micro_batches > 1:
            raise ValueError(f"--micro-batches {p.micro_batches} needs --pp > 1; without a "
                             "pipeline use --grad-accum")
    else:
        validate_schedule_config(p.schedule, p.pp, p.num_micro_batches, p.virtual_stages)
        chunks = p.pp * p.virtual_stages
        if m.n_layer % chunks and not own_model:
            raise ValueError(f"--n-layer {m.n_layer} does not split into pp x virtual-stages "
                             f"= {p.pp} x {p.virtual_stages} = {chunks} equal chunks")
    _check_sequence(cfg)
    if p.reshard_after_forward and p.zero != 3:
        raise ValueError(f"--reshard-after-forward needs --zero 3 (got --zero {p.zero}): it "
                         "picks when ZeRO-3 units are gathered; valid: --zero 3")
    per_step = p.dp * d.grad_accum * p.num_micro_batches
    if d.batch_size % per_step:
        raise ValueError(
            f"--batch-size {d.batch_size} is not divisible by dp x grad-accum x "
            f"micro-batches = {p.dp} x {d.grad_accum} x {p.num_micro_batches} = {per_step}")


def _check_sequence(cfg) -> None:
    """--cp and --sp: what splits the sequence, and what it must be a multiple of."""
    p, d = cfg.parallel, cfg.data
    if p.sp and p.tp == 1:
        raise ValueError("--sp splits the sequence across the tp ranks between their layers "
                         "and needs --tp > 1; valid: --sp with --tp 2 or more, or no --sp")
    if p.cp > 1 and not family(cfg.model.family).plan(
            family(cfg.model.family).make_config(cfg.model.sizes(256))).ring_capable:
        raise ValueError(f"--cp {p.cp}: the attention of --model {cfg.model.preset} cannot "
                         "run as a ring; valid: --cp 1")
    divisor = p.sequence_divisor
    if d.seq_len % divisor:
        what = (f"2 x cp = {2 * p.cp} load-balanced chunks" if p.cp > 1 else "")
        if p.sp:
            what += (" whose tokens split" if what else "slices") + f" across tp = {p.tp}"
        lower = d.seq_len // divisor * divisor
        near = " or ".join(str(n) for n in (lower, lower + divisor) if n > 0)
        raise ValueError(f"--seq-len {d.seq_len} does not split into {what}; valid: a "
                         f"multiple of {divisor}, e.g. --seq-len {near}")


# Which ZeRO stages combine with which axes. The README's table is generated from
# this, and tests/unit/test_config.py checks both that they are equal and that each
# listed combination validates (and runs: tests/e2e/test_layouts.py). Under a
# pipeline, ZeRO-2 keeps each stage's full gradients over the step's micro-batches and
# reduce-scatters once; ZeRO-3 gathers a stage's units once per step (or per
# micro-batch with --reshard-after-forward); tied embeddings get buffers of their own
# so that their shards line up across the first and the last stage.
COMPOSITIONS = [
    # (axes, example flags, ZeRO stages)
    ("dp", "--dp 2", ZERO_STAGES),
    ("dp x tp", "--dp 2 --tp 2", ZERO_STAGES),
    ("dp x tp + sp", "--dp 2 --tp 2 --sp", ZERO_STAGES),
    ("tp x pp", "--tp 2 --pp 2", ZERO_STAGES),
    ("dp x pp", "--dp 2 --pp 2", ZERO_STAGES),
    ("dp x tp x pp", "--dp 2 --tp 2 --pp 2", ZERO_STAGES),
    ("dp x pp, zero bubble", "--dp 2 --pp 2 --schedule zbv --virtual-stages 2 --micro-batches 4",
     ZERO_STAGES),
    ("dp x cp", "--dp 2 --cp 2", ZERO_STAGES),
    ("cp x tp + sp", "--cp 2 --tp 2 --sp", ZERO_STAGES),
    ("cp x pp", "--cp 2 --pp 2", ZERO_STAGES),
    ("dp x cp x tp x pp", "--dp 2 --cp 2 --tp 2 --pp 2 --sp", ZERO_STAGES),
]


def composition_table() -> str:
    """The Markdown table of supported layouts (as in the README)."""
    rows = ["| layout | example | ZeRO stages |", "| --- | --- | --- |"]
    for axes, example, stages in COMPOSITIONS:
        rows.append(f"| {axes} | `{example}` | {', '.join(map(str, stages))} |")
    return "\n".join(rows)
