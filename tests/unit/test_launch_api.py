"""``meshwise.launch.launch`` from Python: what the ranks return comes back by rank."""

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
