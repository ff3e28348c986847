"""Which layouts train, and the table of supported compositions: ``check_layout`` is the one
place that decides (``TrainConfig.validate`` before any rank starts and in every rank; the
planner keeps what it accepts). What only a rank or the launcher knows is checked there.
"""

from __future__ import annotations

from meshwise.comm.allreduce.algorithms import Topology, hierarchical_problem
from meshwise.models.families import family
from meshwise.pipeline.schedules import SCHEDULE_KINDS, validate_schedule_config
from meshwise.train.value_checks import choice, non_negative, positive

ZERO_STAGES = (0, 1, 2, 3)


def _check_experts(cfg, own_model: bool) -> None:
    """--ep: borrowed from dp x cp, on a model with experts it divides; transformers'
    concatenated balancing loss needs every layer in one stage."""
    p = cfg.parallel
    positive(ep=p.ep)
    m = cfg.model.resolved()
    if m.aux_loss_formula == "hf-concatenated" and (m.aux_loss_coef or 0) > 0 and p.pp > 1:
        raise ValueError(
            f"the hf-concatenated balancing loss (transformers') needs every layer's "
            f"router statistics on one stage, not --pp {p.pp}; valid: --pp 1, or "
            "aux_loss_formula per-layer"
        )
    if p.ep == 1:
        return
    if (p.dp * p.cp) % p.ep:
        valid = [e for e in range(1, p.dp * p.cp + 1) if (p.dp * p.cp) % e == 0]
        raise ValueError(
            f"--ep {p.ep} does not divide dp x cp = {p.dp} x {p.cp} (expert parallelism "
            f"borrows those ranks); valid: --ep {', '.join(map(str, valid))}"
        )
    if own_model:
        return
    experts = cfg.model.resolved().n_experts or 0
    if not experts:
        raise ValueError(
            f"--ep {p.ep} on a dense model (no experts); valid: --ep 1, or --n-experts > 0"
        )
    if experts % p.ep:
        valid = [e for e in range(1, experts + 1) if experts % e == 0 and (p.dp * p.cp) % e == 0]
        raise ValueError(
            f"--ep {p.ep} does not divide the {experts} experts; valid: --ep "
            f"{', '.join(map(str, valid))}"
        )


def _check_dp_shard(cfg) -> None:
    """--dp-shard: divides dp; a replica holds whole ep groups (its experts shard within
    it and replicate across); a replica (its consecutive ranks) inside one node of
    --ranks-per-node."""
    p, c = cfg.parallel, cfg.comm
    if p.dp_shard in (0, p.dp):
        return
    if not p.dims.replica_holds_ep:
        fits = [n for n in range(1, p.dp + 1) if p.dp % n == 0 and (n * p.cp) % p.ep == 0]
        raise ValueError(
            f"--dp-shard {p.dp_shard} with --ep {p.ep}: a replica's {p.dp_shard * p.cp} "
            f"dp x cp ranks do not hold whole ep groups (ep divides dp-shard x cp); "
            f"valid: --dp-shard {', '.join(map(str, fits))}"
        )
    others = p.pp * p.cp * p.tp
    replica = p.dims.shard_size * others  # consecutive global ranks (divides dp, or raises)
    per_node = c.ranks_per_node
    if per_node > 0 and per_node % replica:
        fits = [n for n in range(1, p.dp) if p.dp % n == 0 and per_node % (n * others) == 0]
        raise ValueError(
            f"--dp-shard {p.dp_shard} puts a replica of {replica} ranks across nodes of "
            f"--ranks-per-node {per_node}; valid: --dp-shard {', '.join(map(str, fits)) or 'none'}"
        )


def check_layout(cfg, own_model: bool = False) -> None:
    """The axes, the schedule, the sequence, the batch and the gradients' group of ``cfg``
    (a ``TrainConfig``) fit together, or ``ValueError`` names the first that does not;
    ``own_model``: the model is the caller's, its sizes and plan checked by
    ``parallelize`` instead."""
    p, m, d = cfg.parallel, cfg.model.resolved(), cfg.data
    positive(
        dp=p.dp, tp=p.tp, pp=p.pp, cp=p.cp, virtual_stages=p.virtual_stages, grad_accum=d.grad_accum
    )
    non_negative(micro_batches=p.micro_batches)
    choice("--schedule", p.schedule, SCHEDULE_KINDS)
    choice("--zero", p.zero, ZERO_STAGES)
    _check_experts(cfg, own_model)
    _check_dp_shard(cfg)
    if p.tp > 1 and not own_model:
        fam = family(cfg.model.family)
        fam.check_tp(fam.make_config(cfg.model.sizes(max(m.vocab_size, 1))), p.tp)
    if p.pp == 1:
        if p.virtual_stages != 1:
            raise ValueError(f"--virtual-stages {p.virtual_stages} needs --pp > 1")
        if p.micro_batches > 1:
            raise ValueError(
                f"--micro-batches {p.micro_batches} needs --pp > 1; without a "
                "pipeline use --grad-accum"
            )
    else:
        validate_schedule_config(p.schedule, p.pp, p.num_micro_batches, p.virtual_stages)
        chunks = p.pp * p.virtual_stages
        if m.n_layer % chunks and not own_model:
            fits = [n for n in range(2, m.n_layer + 1) if m.n_layer % (n * p.virtual_stages) == 0]
            fits = ([1] if p.virtual_stages == 1 else []) + fits
            pps = f"--pp {', '.join(map(str, fits))}, or " if fits else ""
            raise ValueError(
                f"--n-layer {m.n_layer} does not split into pp x virtual-stages "
                f"= {p.pp} x {p.virtual_stages} = {chunks} equal chunks; valid: "
                f"{pps}--n-layer a multiple of {chunks}"
            )
    _check_sequence(cfg, own_model)
    if p.reshard_after_forward and p.zero != 3:
        raise ValueError(
            f"--reshard-after-forward needs --zero 3 (got --zero {p.zero}): it "
            "picks when ZeRO-3 units are gathered; valid: --zero 3"
        )
    per_step = p.dp * d.grad_accum * p.num_micro_batches
    if d.batch_size % per_step:
        raise ValueError(
            f"--batch-size {d.batch_size} is not divisible by dp x grad-accum x "
            f"micro-batches = {p.dp} x {d.grad_accum} x {p.num_micro_batches} = {per_step}"
        )
    _check_gradient_group(cfg)
    _check_quantized_base(cfg)


def _check_quantized_base(cfg) -> None:
    """--quantize-base nf4 holds the quantised weights beside the engines (whole on every
    rank, ZeRO-3 included: no engine gathers them), dequantised by each layer's own
    forward; not with --compile (the saved-tensor hooks that keep the codes for backward)."""
    base = cfg.lora.quantize_base
    if base == "none":
        return
    if cfg.runtime.compile:
        raise ValueError(
            f"--quantize-base {base} with --compile is not supported yet; valid: leave "
            "--compile out"
        )


def _check_sequence(cfg, own_model: bool) -> None:
    """--cp and --sp: what splits the sequence, and what it must be a multiple of; the
    family's attention must run as a ring (a model of one's own: its plan, in
    ``parallelize``)."""
    p, d = cfg.parallel, cfg.data
    if p.sp and p.tp == 1:
        raise ValueError(
            "--sp splits the sequence across the tp ranks between their layers "
            "and needs --tp > 1; valid: --sp with --tp 2 or more, or no --sp"
        )
    if p.cp > 1 and not own_model:
        _check_ring(cfg)
    divisor = p.sequence_divisor
    if d.seq_len % divisor:
        what = f"2 x cp = {2 * p.cp} load-balanced chunks" if p.cp > 1 else ""
        if p.sp:
            what += (" whose tokens split" if what else "slices") + f" across tp = {p.tp}"
        lower = d.seq_len // divisor * divisor
        near = " or ".join(str(n) for n in (lower, lower + divisor) if n > 0)
        raise ValueError(
            f"--seq-len {d.seq_len} does not split into {what}; valid: a "
            f"multiple of {divisor}, e.g. --seq-len {near}"
        )


def _check_ring(cfg) -> None:
    """Context parallelism runs the family's attention as a ring of key/value blocks."""
    fam = family(cfg.model.family)
    if not fam.plan(fam.make_config(cfg.model.sizes(256))).ring_capable:
        raise ValueError(
            f"--cp {cfg.parallel.cp}: the attention of --model "
            f"{cfg.model.preset} cannot run as a ring; valid: --cp 1"
        )


def _check_gradient_group(cfg) -> None:
    """--ranks-per-node against the world, and --allreduce hierarchical against the dp
    group the gradients are summed over (``meshwise.comm.allreduce.algorithms``)."""
    c, p = cfg.comm, cfg.parallel
    if c.ranks_per_node < 0:
        return  # not a count: the configuration's own check names it
    world = p.dims.world_size
    if c.ranks_per_node and world % c.ranks_per_node:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"--ranks-per-node {c.ranks_per_node} does not divide the world of "
            f"{p.axes_text} = {world} ranks; valid: "
            f"{', '.join(map(str, divisors))}"
        )
    if c.allreduce == "hierarchical":
        per_node = c.ranks_per_node or world
        hybrid = p.dims.num_replicas > 1  # the algorithm sums across the replicas only
        groups = p.dims.shard_groups()[1] if hybrid else p.dims.axes_groups(("dp", "cp"))
        name = "replicate group of --dp-shard" if hybrid else "dp group"
        for ranks in groups:
            problem = hierarchical_problem(Topology.of(ranks, per_node), ranks)
            if problem:
                raise ValueError(
                    f"--allreduce hierarchical cannot serve the {name}: {problem} "
                    f"(--ranks-per-node {per_node}); valid here: native, ring, tree, "
                    f"adaptive, or a --ranks-per-node that puts 2+ nodes in each {name}"
                )


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
    (
        "dp x pp, zero bubble",
        "--dp 2 --pp 2 --schedule zbv --virtual-stages 2 --micro-batches 4",
        ZERO_STAGES,
    ),
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
