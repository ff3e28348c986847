"""One place decides whether a layout trains: the command line, the planner and the
trainer all ask ``check_layout``."""

import pytest

from meshwise.planner.layout import Layout
from meshwise.planner.search import _valid
from meshwise.train.config import TrainConfig
from meshwise.train.layout_rules import check_layout
from meshwise.train.trainer import Trainer


def _config(**parallel) -> TrainConfig:
    cfg = TrainConfig()
    for name, value in parallel.items():
        setattr(cfg.parallel, name, value)
    return cfg


def test_context_parallel_takes_a_sliding_window_shorter_than_the_sequence():
    # The ring masks each block by global position and skips blocks a whole window
    # behind their queries (tests/dist/test_context_parallel.py holds it exact).
    cfg = _config(cp=2)
    cfg.model.preset, cfg.model.sliding_window, cfg.data.seq_len = "llama-tiny", 16, 32
    cfg.validate()
    cfg.model.preset = "tiny"  # the GPT: a ring, no window
    cfg.model.sliding_window = None
    cfg.validate()


def test_the_gradient_group_is_part_of_the_layout():
    cfg = _config(dp=2)
    cfg.comm.ranks_per_node = 3
    with pytest.raises(
        ValueError, match="--ranks-per-node 3 does not divide the world of dp x tp x pp = 2 ranks"
    ):
        check_layout(cfg)
    cfg.comm.ranks_per_node, cfg.comm.allreduce = 0, "hierarchical"
    with pytest.raises(ValueError, match="--allreduce hierarchical cannot serve the dp group"):
        check_layout(cfg)
    # The planner asks the same rules: with two ranks per node, a dp group of 4 spans
    # two nodes; one of 2 (with tp 2) does not.
    cfg.comm.ranks_per_node = 2
    assert _valid(cfg, Layout(dp=4)) and not _valid(cfg, Layout(dp=2, tp=2))


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"sp": True}, "--sp splits the sequence across the tp ranks"),
        ({"dp": 0}, "--dp must be a finite number > 0, got 0"),
        ({"zero": 4}, "--zero 4 is not valid; valid: 0, 1, 2, 3"),
    ],
)
def test_the_trainer_refuses_what_the_command_line_refuses(changes, message):
    """Before it touches a process group: the same check, in every rank."""
    with pytest.raises(ValueError, match=message):
        Trainer(_config(**changes), "unused.bin")
    with pytest.raises(ValueError, match=message):
        _config(**changes).validate()
