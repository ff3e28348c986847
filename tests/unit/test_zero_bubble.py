"""Schedules with a split backward (ZB-H1, ZB-V, DualPipeV): orders, stage map, validator,
simulator, and agreement with torch.distributed.pipelining's orders."""

import dataclasses
import json

import pytest

from meshwise.pipeline.actions import stage_index, stage_owner
from meshwise.pipeline.schedules import (
    SCHEDULE_KINDS,
    SPLIT_BACKWARD,
    ScheduleError,
    build_schedule,
    from_compute_orders,
    parse_action,
    validate_schedule_config,
)
from meshwise.pipeline.simulator import reference_bubble, render_text, simulate
from meshwise.pipeline.validate import validate

SPLIT = (("zb-h1", 1), ("zbv", 2), ("dualpipev", 2))


def compute(schedule, rank):
    return [str(a) for a in schedule.compute_actions(rank)]


def _valid_m(kind, S):
    return range(2 * S, 3 * S + 2) if kind == "dualpipev" else range(1, 3 * S + 2)


@pytest.mark.parametrize("kind, V", SPLIT)
def test_every_split_schedule_runs_with_blocking_and_eager_sends(kind, V):
    for S in range(1, 7):
        for M in _valid_m(kind, S):
            schedule = build_schedule(kind, S, M, V)
            simulate(schedule, blocking_sends=True)  # validates: complete, no deadlock
            for rank in range(S):
                weights = [a for a in schedule.compute_actions(rank) if a.kind == "W"]
                assert len(weights) <= M * V


def test_split_backward_names_the_kinds_with_weight_passes():
    V = {"interleaved-1f1b": 2, "zbv": 2, "dualpipev": 2}
    split = [k for k in SCHEDULE_KINDS if build_schedule(k, 2, 4, V.get(k, 1)).has_weight_actions]
    assert tuple(split) == SPLIT_BACKWARD


def test_zb_h1_postpones_the_first_rank_weight_passes():
    schedule = build_schedule("zb-h1", 4, 8)
    assert compute(schedule, 0)[:8] == ["F0", "F1", "F2", "F3", "B0", "W0", "F4", "B1"]
    # rank 3 keeps 3 weight passes for the cool-down, where 1F1B idles
    assert compute(schedule, 3)[:7] == ["F0", "B0", "F1", "B1", "F2", "B2", "F3"]
    assert compute(schedule, 3)[-4:] == ["W4", "W5", "W6", "W7"]


def test_v_stage_map_is_its_own_inverse_and_puts_both_ends_on_rank_0():
    for S in range(1, 6):
        stages = sorted(stage_index(r, c, S, "v") for r in range(S) for c in range(2))
        assert stages == list(range(2 * S))
        for r in range(S):
            for c in range(2):
                assert stage_owner(stage_index(r, c, S, "v"), S, "v") == (r, c)
    assert stage_owner(0, 4, "v") == (0, 0) and stage_owner(7, 4, "v") == (0, 1)
    assert stage_owner(3, 4, "v") == (3, 0) and stage_owner(4, 4, "v") == (3, 1)


def test_zbv_turns_on_the_last_rank_without_a_message():
    schedule = build_schedule("zbv", 2, 4, 2)
    assert schedule.stage_map == "v" and schedule.stage_of(0, 1) == 3
    rank1 = [str(a) for a in schedule.ranks[1]]
    # stage 1 (rank 1, chunk 0) hands its output to stage 2 (rank 1, chunk 1) locally
    assert not any(s.startswith(("SF0.0", "RF0.1")) for s in rank1)
    assert "SF0.1>0" in rank1  # stage 2 sends to stage 3 on rank 0
    rank0 = [str(a) for a in schedule.ranks[0]]
    assert not any(s.startswith("SF") and ".1>" in s for s in rank0)  # the loss stage sends none


@pytest.mark.parametrize(
    "rank, actions, message",
    [
        (0, "F0 SF0>1 F1 SF1>1 RB0<1 W0 B0 RB1<1 B1 W1", "W0 on chunk 0 runs before B0"),
        (0, "F0 SF0>1 F1 SF1>1 RB0<1 B0 W0 W0 RB1<1 B1 W1", "W0 appears twice"),
    ],
)
def test_validator_checks_weight_passes(rank, actions, message):
    schedule = build_schedule("zb-h1", 2, 2)
    ranks = [list(r) for r in schedule.ranks]
    ranks[rank] = [parse_action(s) for s in actions.split()]
    with pytest.raises(ScheduleError, match=message):
        validate(dataclasses.replace(schedule, ranks=ranks))


def test_a_backward_without_its_weight_pass_is_a_whole_backward():
    orders = [[("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0), ("W", 1, 0)]]
    schedule = from_compute_orders("custom", 1, 2, 1, orders)
    assert not schedule.splits_backward(0, 0, 0) and schedule.splits_backward(0, 1, 0)
    timeline = simulate(schedule, 1.0, 1.0, 1.0)
    assert timeline.step_time == 6.0 and timeline.peak_in_flight == [1]
    with pytest.raises(ScheduleError, match="at most once"):
        from_compute_orders("custom", 1, 2, 1, [orders[0] + [("W", 1, 0)]])


@pytest.mark.parametrize(
    "args, words",
    [
        (("zbv", 2, 4, 1), ["zbv runs two chunks per rank in a V", "must be 2, got 1"]),
        (("dualpipev", 2, 4, 3), ["must be 2, got 3"]),
        (("zb-h1", 2, 4, 2), ["virtual stages = 2", "interleaved-1f1b, zbv or dualpipev"]),
        (("dualpipev", 4, 7, 2), ["micro-batches >= 2 x pp", "micro-batches=7", "valid: 8, 9"]),
    ],
)
def test_split_schedules_name_what_they_need(args, words):
    with pytest.raises(ValueError) as info:
        validate_schedule_config(*args)
    for word in words:
        assert word in str(info.value)


# --- the simulator: bubbles and memory -------------------------------------------------------


def test_bubbles_at_pp4_m8_against_1f1b_and_the_literature():
    one_f_one_b = simulate(build_schedule("1f1b", 4, 8))
    zb_h1 = simulate(build_schedule("zb-h1", 4, 8))
    zbv = simulate(build_schedule("zbv", 4, 8, 2))
    dualpipev = simulate(build_schedule("dualpipev", 4, 8, 2))
    idle = {
        name: t.bubble_fraction * t.step_time
        for name, t in [
            ("1f1b", one_f_one_b),
            ("zb-h1", zb_h1),
            ("zbv", zbv),
            ("dualpipev", dualpipev),
        ]
    }
    assert idle == pytest.approx({"1f1b": 9.0, "zb-h1": 3.0, "zbv": 1.5, "dualpipev": 1.5})
    # ZB-H1 idles a third of 1F1B; as a fraction of the step, 0.407 of it
    assert zb_h1.bubble_fraction / one_f_one_b.bubble_fraction == pytest.approx(11 / 27)
    # ZB-V reaches the bound of any schedule: the last rank waits (S-1) chunk forwards
    assert zbv.step_time == pytest.approx(3 * 0.5 + 8 * 3)
    for kind, V, timeline in (("zb-h1", 1, zb_h1), ("zbv", 2, zbv), ("dualpipev", 2, dualpipev)):
        assert timeline.bubble_fraction == pytest.approx(reference_bubble(kind, 4, 8, V)[0])
    # ZB-H1 keeps 1F1B's peak: the first rank's S micro-batches in flight
    assert max(zb_h1.peak_in_flight) == max(one_f_one_b.peak_in_flight) == 4
    assert max(zbv.peak_in_flight) == 8  # of half-size chunks: 1F1B's activation memory


def test_costs_scale_and_split_the_backward():
    schedule = build_schedule("zb-h1", 2, 4)
    slow_weights = simulate(schedule, 1.0, 1.0, 3.0)
    assert slow_weights.step_time > simulate(schedule).step_time
    assert simulate(schedule, 2.0, 2.0, 2.0).bubble_fraction == pytest.approx(
        simulate(schedule).bubble_fraction
    )
    import math

    assert math.isnan(reference_bubble("zb-h1", 2, 4, 1, (1.0, 2.0, 1.0))[0])


def test_render_marks_weight_passes():
    text = render_text(simulate(build_schedule("zb-h1", 2, 2)))
    assert "{n} = weight pass" in text and "{0}" in text and "[0]" in text


# --- agreement with torch.distributed.pipelining ----------------------------------------------


def _torch_orders(kind, S, M):
    """Compute orders from torch's zero-bubble schedule classes, without a process group."""
    from types import SimpleNamespace

    schedules = pytest.importorskip("torch.distributed.pipelining.schedules")
    try:
        if kind == "zb-h1":  # torch's interleaved zero bubble with one stage per rank
            state = SimpleNamespace(
                n_local_stages=1,
                pp_group_size=S,
                _n_microbatches=M,
                microbatches_per_round=M // max(1, M // S),
            )
            ops = schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations
        else:
            state = SimpleNamespace(pp_group_size=S, _n_microbatches=M, num_stages=2 * S)
            cls = schedules.ScheduleZBVZeroBubble if kind == "zbv" else schedules.ScheduleDualPipeV
            ops = cls._calculate_single_rank_operations
        per_rank = [ops(state, r) for r in range(S)]
    except (AttributeError, TypeError) as exc:  # private API moved: nothing to compare with
        pytest.skip(f"torch's private schedule API changed: {exc}")
    stage_map = "loop" if kind == "zb-h1" else "v"
    kinds = {"F": "F", "I": "B", "B": "B", "W": "W"}  # torch's I: our B when a W follows
    orders = []
    for actions in per_rank:
        subs = [s for a in actions if a is not None for s in (a.sub_actions or (a,))]
        orders.append(
            [
                (
                    kinds[s.computation_type.value],
                    s.microbatch_index,
                    stage_owner(s.stage_index, S, stage_map)[1],
                )
                for s in subs
            ]
        )
    return orders


@pytest.mark.parametrize("kind, V", SPLIT)
def test_orders_agree_with_torch_pipelining(kind, V):
    compared = 0
    for S in range(2, 7):
        for M in _valid_m(kind, S):
            if kind == "zb-h1" and M % max(1, M // S):
                continue  # torch's rounds need M to be a multiple of M // S
            ours = build_schedule(kind, S, M, V)
            mine = [
                [(a.kind, a.micro_batch, a.chunk) for a in ours.compute_actions(r)]
                for r in range(S)
            ]
            assert mine == _torch_orders(kind, S, M), (kind, S, M)
            compared += 1
    assert compared >= 30


def test_schedule_command_takes_costs_and_shows_the_reference(capsys):
    import argparse

    from meshwise.cli.schedule import add_schedule_arguments, run_schedule

    parser = argparse.ArgumentParser(prog="meshwise schedule")
    add_schedule_arguments(parser)
    argv = "--pp 4 --micro-batches 8 --schedule zbv --virtual-stages 2 --json".split()
    assert run_schedule(parser.parse_args(argv)) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"][0][:8] == ["F0.0", "F1.0", "F2.0", "F3.0", "F4.0", "F5.0", "F6.0", "F0.1"]
    assert "W0.1" in data["ranks"][0] and data["weight_cost"] == 1.0
    assert data["bubble_fraction"] == pytest.approx(data["bubble_fraction_formula"])
    assert run_schedule(parser.parse_args(argv[:-1] + ["--costs", "1,2"])) == 2
    err = capsys.readouterr().err
    assert "--costs '1,2' is not valid; valid: three numbers > 0" in err and err.count("\n") == 1
