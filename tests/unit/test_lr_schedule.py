"""Learning-rate schedules, and resuming that continues a schedule or says how to change it."""

import dataclasses
import math

import pytest

from meshwise.train.config import OptimConfig, recorded_section
from meshwise.train.lr_schedule import (
    LRSchedule,
    check_schedule,
    lr_at,
    resumed_start,
    warmup_warning,
)


def _optim(**changes) -> OptimConfig:
    return dataclasses.replace(OptimConfig(lr=1.0, warmup_steps=10, steps=100), **changes)


def test_cosine_is_the_schedule_it_always_was():
    for step in (1, 5, 10, 11, 50, 100, 120):
        progress = min(1.0, (step - 10) / 90)
        want = step / 10 if step <= 10 else 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
        assert lr_at(step, 1.0, 10, 100) == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize(
    "shape, middle", [("linear", 0.55), ("sqrt", 1 - 0.9 * 0.5**0.5), ("cosine", 0.55)]
)
def test_wsd_warms_up_holds_then_decays_over_its_last_steps(shape, middle):
    schedule = LRSchedule("wsd", 1.0, 10, 100, decay_steps=20, decay_shape=shape)
    assert [schedule.lr(s) for s in (5, 10, 11, 80)] == [0.5, 1.0, 1.0, 1.0]
    assert schedule.lr(90) == pytest.approx(middle)
    assert schedule.lr(100) == pytest.approx(0.1) and schedule.lr(81) < 1.0
    assert LRSchedule("wsd", 1.0, 10, 100).wsd_decay_steps == 20  # a fifth by default
    assert LRSchedule("constant", 1.0, 10, 100).lr(100) == 1.0


def test_a_longer_wsd_run_continues_while_it_is_stable():
    first = LRSchedule.of(_optim(lr_schedule="wsd", decay_steps=20))
    longer = LRSchedule.of(_optim(lr_schedule="wsd", decay_steps=20, steps=200))
    assert longer.continues(first, 80) and not longer.continues(first, 81)
    assert LRSchedule.of(_optim(lr_schedule="constant", steps=500)).continues(
        LRSchedule.of(_optim(lr_schedule="constant")), 100
    )


def test_resuming_a_cosine_with_more_steps_is_refused_saying_how_to_go_on():
    saved = _optim(steps=40)
    with pytest.raises(ValueError) as err:
        resumed_start(_optim(steps=50), saved, 40)
    message = str(err.value)
    assert "at steps 1 to 40" in message and "re-stretch" in message and "\n" not in message
    assert (
        "valid: resume with --lr-schedule cosine --lr 1 --warmup-steps 10 --steps 40, or "
        "add --lr-restart" in message
    )
    assert resumed_start(_optim(steps=40), saved, 40) == 0  # the same schedule goes on
    assert resumed_start(_optim(steps=50, lr_restart=True), saved, 40) == 40
    # A restarted schedule goes on from where it started when resumed again.
    restarted = _optim(steps=50, lr_restart=True)
    assert resumed_start(_optim(steps=50, lr_restart=True), restarted, 45, 40) == 40
    assert LRSchedule.of(restarted, 40).lr(41) == pytest.approx(0.1)  # warming up again


def test_a_checkpoint_from_before_schedules_is_a_cosine():
    old = recorded_section(OptimConfig, {"lr": 1.0, "warmup_steps": 10, "steps": 100})
    assert resumed_start(_optim(), old, 60) == 0
    with pytest.raises(ValueError, match="--lr-schedule wsd"):
        resumed_start(_optim(lr_schedule="wsd"), old, 60)


@pytest.mark.parametrize(
    "changes, message",
    [
        (
            {"lr_schedule": "linear"},
            "--lr-schedule 'linear' is not valid; valid: cosine, wsd, constant",
        ),
        ({"decay_shape": "exp"}, "--decay-shape 'exp' is not valid; valid: linear, sqrt, cosine"),
        (
            {"decay_steps": 95},
            "--decay-steps 95 is not valid with --steps 100 --warmup-steps 10; valid: 1 to 90",
        ),
        ({"min_lr_ratio": 1.5}, "--min-lr-ratio 1.5 is not valid; valid: 0 to 1"),
    ],
)
def test_bad_schedules_name_the_valid_values(changes, message):
    with pytest.raises(ValueError, match=message):
        check_schedule(
            OptimConfig(
                **{**dataclasses.asdict(OptimConfig(warmup_steps=10, steps=100)), **changes}
            )
        )


@pytest.mark.parametrize("kind", ["cosine", "wsd", "constant"])
def test_a_warmup_longer_than_the_run_is_clamped_and_said(kind):
    optim = _optim(lr=1e-3, warmup_steps=20, steps=10, lr_schedule=kind)
    rates = [LRSchedule.of(optim).lr(step) for step in range(1, 11)]
    assert max(rates) == pytest.approx(1e-3)  # the rate reaches --lr ...
    if kind != "constant":
        assert rates[-1] < 1e-3  # ... and its decay starts
    assert warmup_warning(optim) == (
        "--warmup-steps 20 is not shorter than --steps 10: warming up over 1 steps "
        "instead, so the rate reaches --lr 0.001 and decays; give --warmup-steps below "
        "--steps to choose"
    )
    assert warmup_warning(_optim(warmup_steps=9, steps=10)) is None
