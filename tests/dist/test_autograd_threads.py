"""Backward on another thread than the forward, as CUDA's autograd engine runs it.

On a GPU the engine runs a backward on its per-device worker thread while the
thread that called ``backward()`` waits, so every operation a backward issues
(bucket reductions from gradient hooks, ZeRO-3's gathers and reduce-scatters,
tensor-parallel mappings' backwards, ring attention's backward, recomputed
forwards) comes from that worker thread, and the forward's from the caller. On
the CPU the engine runs it on the caller's thread, so here each rank's
``torch.autograd.backward`` is swapped for one that runs the original on a new
thread and joins it; the strict mode (``MESHWISE_COMM_CHECK=nccl``) must let a
training step through, and the new threads must really have issued operations.
"""

import threading

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(120)

LAYOUTS = {
    "dp2": {"dp": 2},
    "tp2": {"tp": 2},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "cp2": {"cp": 2},
    # the recomputed forward's all-reduces come from the backward's thread too
    "tp2-checkpointed": {"tp": 2, "activation_checkpointing": "full"},
    # split backward: each B and W pass (meshwise.tensor_parallel.weight_grads) a backward
    "dp2-pp2-zbv-zero3": {"dp": 2, "pp": 2, "schedule": "zbv", "virtual_stages": 2,
                          "micro_batches": 2, "zero": 3, "n_layer": 4},
}


def _issued(ledger) -> int:
    return sum(count for count, _ in ledger.summary().values())


def _steps_with_backward_on_other_threads(layout: dict, data_path: str):
    from meshwise.comm import ops
    from meshwise.train.config import TrainConfig
    from meshwise.train.trainer import Trainer

    cfg = TrainConfig()
    cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head = 2, 32, 2
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, 16, 4
    cfg.optim.steps, cfg.runtime.device, cfg.runtime.quiet = 2, "cpu", True
    for key, value in layout.items():
        section = next(s for s in (cfg.model, cfg.parallel, cfg.runtime) if hasattr(s, key))
        setattr(section, key, value)
    trainer = Trainer(cfg.validate(), data_path)
    ledger, original = ops.context().ledger, torch.autograd.backward
    issued_there = []

    def on_another_thread(*args, **kwargs):
        failed, before = [], _issued(ledger)

        def run():
            try:
                original(*args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - re-raised on the caller's thread
                failed.append(exc)

        worker = threading.Thread(target=run, name="autograd-worker")
        worker.start()
        worker.join()
        issued_there.append(_issued(ledger) - before)  # the caller issued none meanwhile
        if failed:
            raise failed[0]

    torch.autograd.backward = on_another_thread
    try:
        records = [trainer.train_step(step) for step in (1, 2)]
    finally:
        torch.autograd.backward = original
    trainer.comm_stats.close()
    return [r["loss"] for r in records], issued_there


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_step_whose_backward_issues_from_another_thread_passes(dist_pools, tokens, name):
    layout = LAYOUTS[name]
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    for losses, issued_there in dist_pools.run(world, _steps_with_backward_on_other_threads,
                                               layout, tokens):
        assert all(np.isfinite(losses)), losses
        assert issued_there and sum(issued_there) > 0, issued_there
