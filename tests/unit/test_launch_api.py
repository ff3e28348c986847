"""``meshwise.launch.launch`` from Python: what the ranks return comes back by rank."""

import pytest
import torch

from meshwise import launch


def _rank_and_tensor():
    rank = torch.distributed.get_rank()
    return {"rank": rank, "loss": torch.tensor([float(rank)])}


def test_launch_returns_each_ranks_result_by_rank(monkeypatch):
    for name in launch.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    results = launch.launch(_rank_and_tensor, (), world_size=2, device="cpu", timeout_s=60)
    assert [r["rank"] for r in results] == [0, 1]
    assert [r["loss"].item() for r in results] == [0.0, 1.0]


def _bad_plan():
    from meshwise import ParallelPlan

    ParallelPlan(layers="blocks", tp=(("blocks.*.attn", "diagonal"),))


def _bad_config():
    from meshwise import TrainConfig

    cfg = TrainConfig()
    cfg.parallel.tp = 0
    cfg.validate()


def _own_bug():
    return int("twelve")  # a ValueError of the user's code, not a mistake meshwise names


def _failure(fn) -> str:
    with pytest.raises(launch.RankFailed) as failed:
        launch.launch(fn, (), world_size=1, device="cpu", timeout_s=60)
    return str(failed.value)


def test_a_mistake_meshwise_names_is_one_line_and_its_traceback_on_request(monkeypatch):
    for name in launch.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.delenv("MESHWISE_DEBUG", raising=False)
    assert _failure(_bad_plan) == (
        "rank 0: plan: style 'diagonal' for 'blocks.*.attn'; valid: colwise, rowwise, "
        "vocab_embedding, vocab_head, position_embedding, shard_norm"
    )
    line = _failure(_bad_config)
    assert line.startswith("rank 0: ") and "\n" not in line, line
    assert "Traceback" in _failure(_own_bug)
    monkeypatch.setenv("MESHWISE_DEBUG", "1")
    assert "Traceback" in _failure(_bad_plan)
    with pytest.raises(ValueError):  # as before: except ValueError still catches it
        _bad_plan()


def test_each_rank_takes_its_share_of_the_cores_available(monkeypatch):
    for name in launch.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: set(range(6)), raising=False)
    threads = launch.launch(torch.get_num_threads, (), world_size=2, device="cpu", timeout_s=60)
    assert threads == [3, 3]  # 6 cores available, 2 ranks on this machine
    # Under torchrun the ranks that share this host split it, whichever agent started them.
    assert launch.ranks_here(["a", "b", "a", "a"], "a") == 3


def _unpicklable():
    return lambda: None


def test_a_result_that_does_not_pickle_comes_back_as_none(monkeypatch, capfd):
    for name in launch.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    assert launch.launch(_unpicklable, (), world_size=1, device="cpu", timeout_s=60) == [None]
    assert "rank 0 returned a value that does not pickle" in capfd.readouterr().err
