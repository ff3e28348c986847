"""Pipeline schedules as data (pure): GPipe, 1F1B, interleaved 1F1B, ZB-H1, ZB-V and
DualPipeV, each rank's actions with messages placed so no batch can deadlock. The
contract a runtime follows: docs/pipelines.md "The schedule's contract".
"""

from __future__ import annotations

# The data model, re-exported: the schedules' public names live here.
from meshwise.pipeline.actions import (  # noqa: F401
    COMM_KINDS,
    COMPUTE_KINDS,
    STAGE_MAPS,
    Action,
    Order,
    Schedule,
    ScheduleError,
    Step,
    group_steps,
    parse_action,
    stage_index,
    stage_owner,
)
from meshwise.pipeline.placement import place_messages
from meshwise.pipeline.zero_bubble import dualpipev_order, zb_h1_order, zbv_order

SCHEDULE_KINDS = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zbv", "dualpipev")
SPLIT_BACKWARD = ("zb-h1", "zbv", "dualpipev")  # kinds with W actions (a split backward)
# Chunks per rank a kind runs (None: any V >= 2) and its stage map.
_CHUNKS = {"gpipe": 1, "1f1b": 1, "interleaved-1f1b": None, "zb-h1": 1, "zbv": 2, "dualpipev": 2}
STAGE_MAP_OF = {"zbv": "v", "dualpipev": "v"}


def validate_schedule_config(
    kind: str, num_stages: int, num_micro_batches: int, num_virtual_stages: int = 1
) -> None:
    """Raise ValueError with a one-line message if no schedule exists for these values.

    gpipe, 1f1b and zb-h1 take any M >= 1; interleaved-1f1b needs V >= 2 and M a multiple
    of S (Megatron's groups of S); zbv and dualpipev run two chunks per rank, dualpipev with
    M >= 2S (as torch.distributed.pipelining's).
    """
    if kind not in SCHEDULE_KINDS:
        raise ValueError(f"schedule {kind!r} is not one of: {', '.join(SCHEDULE_KINDS)}")
    for name, value in (
        ("pp (pipeline stages)", num_stages),
        ("micro-batches", num_micro_batches),
        ("virtual stages", num_virtual_stages),
    ):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    chunks = _CHUNKS[kind]
    if chunks == 1 and num_virtual_stages != 1:
        with_more = "interleaved-1f1b, zbv or dualpipev"
        raise ValueError(
            f"virtual stages = {num_virtual_stages} needs schedule {with_more}; "
            f"{kind} runs one chunk per rank (virtual stages 1)"
        )
    if chunks == 2 and num_virtual_stages != 2:
        raise ValueError(
            f"{kind} runs two chunks per rank in a V: virtual stages must be 2, "
            f"got {num_virtual_stages}"
        )
    if kind == "interleaved-1f1b":
        if num_virtual_stages < 2:
            raise ValueError(
                f"interleaved-1f1b needs virtual stages >= 2, got {num_virtual_stages}"
                " (with 1 chunk per rank use 1f1b)"
            )
        if num_micro_batches % num_stages:
            raise ValueError(
                f"interleaved-1f1b needs micro-batches to be a multiple of pp: got "
                f"micro-batches={num_micro_batches}, pp={num_stages}; valid: "
                f"{num_stages}, {2 * num_stages}, {3 * num_stages}, ..."
            )
    if kind == "dualpipev" and num_micro_batches < 2 * num_stages:
        raise ValueError(
            f"dualpipev needs micro-batches >= 2 x pp: got micro-batches="
            f"{num_micro_batches}, pp={num_stages}; valid: {2 * num_stages}, "
            f"{2 * num_stages + 1}, ..."
        )


def build_schedule(
    kind: str, num_stages: int, num_micro_batches: int, num_virtual_stages: int = 1
) -> Schedule:
    """Build the per-rank action lists (compute and communication) of a schedule kind."""
    validate_schedule_config(kind, num_stages, num_micro_batches, num_virtual_stages)
    S, M, V = num_stages, num_micro_batches, num_virtual_stages
    order = {
        "gpipe": _gpipe_order,
        "1f1b": _one_f_one_b_order,
        "interleaved-1f1b": _interleaved_order,
        "zb-h1": zb_h1_order,
        "zbv": zbv_order,
        "dualpipev": dualpipev_order,
    }[kind]
    return from_compute_orders(
        kind, S, M, V, [order(S, M, V, r) for r in range(S)], STAGE_MAP_OF.get(kind, "loop")
    )


def from_compute_orders(
    kind: str,
    num_stages: int,
    num_micro_batches: int,
    num_virtual_stages: int,
    orders: list[Order],
    stage_map: str = "loop",
) -> Schedule:
    """A schedule from each rank's compute order, given as ``(kind, micro_batch, chunk)`` tuples
    (e.g. ``("F", 3, 0)``), with the sends and receives placed for it.  Every micro-batch and
    chunk runs F and B once and W at most once (after its B).  Raises ScheduleError when an order
    misses or repeats an action or the orders wait on each other forever."""
    M, V = num_micro_batches, num_virtual_stages
    if stage_map not in STAGE_MAPS:
        raise ScheduleError(f"stage map {stage_map!r} is not one of: {', '.join(STAGE_MAPS)}")
    expected = {(k, m, c) for k in ("F", "B") for m in range(M) for c in range(V)}
    for rank, order in enumerate(orders):
        weights = {(m, c) for k, m, c in order if k == "W"}
        if len(order) != len(expected) + len(weights) or set(order) != expected | {
            ("W", m, c) for m, c in weights
        }:
            raise ScheduleError(
                f"rank {rank}: the compute order must hold F and B once (and W at "
                f"most once) for every micro-batch in 0..{M - 1} and chunk in "
                f"0..{V - 1}"
            )
    ranks = place_messages(orders, num_stages, V, stage_map)
    return Schedule(kind, num_stages, M, V, ranks, stage_map)


def _gpipe_order(S: int, M: int, V: int, rank: int) -> Order:
    # GPipe (Huang et al. 2019): every forward, then every backward; all M activations live.
    return [("F", m, 0) for m in range(M)] + [("B", m, 0) for m in range(M)]


def _one_f_one_b_order(S: int, M: int, V: int, rank: int) -> Order:
    # PipeDream-Flush 1F1B (Narayanan et al. 2021, section 2.2.1): at most S - rank live
    # activations instead of GPipe's M, for the same bubble.
    num_warmup = min(S - rank - 1, M)
    num_steady = M - num_warmup
    order = [("F", m, 0) for m in range(num_warmup)]  # warmup: forwards only
    for i in range(num_steady):  # steady state: one F, one B
        order += [("F", num_warmup + i, 0), ("B", i, 0)]
    order += [("B", m, 0) for m in range(num_steady, M)]  # cooldown: backwards only
    return order


def _interleaved_slot(k: int, S: int, V: int, forward: bool) -> tuple[int, int]:
    # Megatron's order (Narayanan et al. 2021, section 2.2.2): micro-batches in groups of S go
    # through chunk 0, then chunk 1, ...; backwards visit the chunks in reverse.
    group, position = divmod(k, S * V)
    chunk, index = divmod(position, S)
    return group * S + index, (chunk if forward else V - 1 - chunk)


def _interleaved_order(S: int, M: int, V: int, rank: int) -> Order:
    total = M * V
    # Megatron's warmup count: the (V - 1) groups of the earlier chunks, plus 2 per hop to the
    # last rank (a forward going down and a backward coming back), capped at every forward.
    num_warmup = min((S - rank - 1) * 2 + (V - 1) * S, total)
    num_steady = total - num_warmup
    slot = _interleaved_slot
    order = [("F", *slot(k, S, V, True)) for k in range(num_warmup)]  # warmup
    for i in range(num_steady):  # steady state
        order += [("F", *slot(num_warmup + i, S, V, True)), ("B", *slot(i, S, V, False))]
    order += [("B", *slot(k, S, V, False)) for k in range(num_steady, total)]  # cooldown
    return order
