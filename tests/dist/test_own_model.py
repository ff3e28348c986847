"""A model of one's own (examples/own_model.py) trained through the public API on
every layout, against a plain single-process PyTorch loop, to 1e-5 per step."""

import os

import pytest
import torch

from examples.own_model import LAYOUTS, PLAN, TinyLM, config, reference, train, write_tokens


@pytest.fixture(scope="module")
def data_path(tmp_path_factory):
    return write_tokens(tmp_path_factory.mktemp("own") / "tokens.bin")


@pytest.fixture(scope="module")
def expected(data_path):
    return reference(config(), data_path)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(LAYOUTS))
def test_the_example_trains_like_plain_pytorch_on_every_layout(dist_pools, data_path,
                                                               expected, name):
    # pp 2 syncs the tie across stages; tp 2 keeps the vocabulary's padding column
    # (257 ids, split in two) out of the softmax; ZeRO-3 draws each module's own init.
    losses = dist_pools.run(2, train, config(**LAYOUTS[name]), data_path, timeout=200)
    for rank_losses in losses:
        assert max(abs(a - b) for a, b in zip(rank_losses, expected)) <= 1e-5, (
            rank_losses, expected)


def _pipeline_by_hand(data_path: str, steps: int) -> list[float]:
    """The lower-level path docs/own-model.md shows: parallelize, an engine, the pipeline
    runtime, finish_grad_sync, step. The cross-stage tie is summed by the engine."""
    from meshwise import (
        AdamWConfig,
        Mesh,
        ParallelDims,
        PipelineRuntime,
        ZeroOptimizer,
        build_schedule,
        parallelize,
    )
    from meshwise.comm import ops
    from meshwise.data.dataset import TokenDataset
    from meshwise.train.lr_schedule import lr_at

    cfg = config(steps=steps)
    o, d = cfg.optim, cfg.data
    mesh = Mesh.build(ParallelDims(pp=2))
    with torch.device("meta"):
        model = TinyLM()
    parts = parallelize(model, PLAN, mesh=mesh)
    opt = ZeroOptimizer(parts.named_parameters(), mesh.dp_group, stage=1,
                        adamw=AdamWConfig(lr=o.lr, betas=(o.beta1, o.beta2),
                                          weight_decay=o.weight_decay),
                        modules=parts.chunks, values=parts.init_values(seed=d.seed))
    runtime = PipelineRuntime(parts.chunks, build_schedule("1f1b", 2, 2), mesh.pp_group, opt,
                              loss_fn=parts.loss)
    data, losses = TokenDataset(data_path, d.seq_len), []
    for step in range(1, steps + 1):
        batch = data.global_batch(step, d.batch_size, d.seed, "train")  # (B, T + 1)
        micro = [(mb[:, :-1], mb[:, 1:]) for mb in batch.chunk(2)]
        opt.zero_grad()
        loss = runtime.run(micro, 1.0 / batch[:, 1:].numel()).reshape(1)
        opt.finish_grad_sync()
        opt.step(lr=lr_at(step, o.lr, o.warmup_steps, o.steps))
        ops.all_reduce(loss, mesh.pp_group)  # the last stage holds the loss
        losses.append(loss.item())
    return losses


@pytest.mark.timeout(120)
def test_a_pipeline_by_hand_syncs_the_tie_across_stages(dist_pools, data_path):
    cfg = config(steps=3)
    cfg.optim.clip = 0.0  # clipping needs the global norm: the Trainer's
    expected = reference(cfg, data_path)
    for losses in dist_pools.run(2, _pipeline_by_hand, data_path, 3):
        assert max(abs(a - b) for a, b in zip(losses, expected)) <= 1e-5, (losses, expected)



def _save_then_resume(data_path: str, save_dir: str) -> tuple[list[float], list[float]]:
    """4 steps straight, and 2 + 2 with a checkpoint between (pp 2: the tie's copies)."""
    from meshwise import Trainer

    def run(steps_cfg, resume=None):
        return Trainer(steps_cfg, data_path, resume=resume, model=TinyLM, plan=PLAN).train()

    straight = [r["loss"] for r in run(config(steps=4, pp=2))]
    cfg = config(steps=4, pp=2)
    cfg.checkpoint.save, cfg.checkpoint.save_every = save_dir, 2
    first = run(cfg)  # saves at steps 2 and 4
    cfg.checkpoint.save = f"{save_dir}/resumed"  # a checkpoint is never overwritten
    os.makedirs(cfg.checkpoint.save, exist_ok=True)
    resumed = run(cfg, resume=f"{save_dir}/step-00000002")
    return straight, [r["loss"] for r in first[:2] + resumed]


@pytest.mark.timeout(180)
def test_a_resumed_run_continues_as_if_never_stopped(dist_pools, data_path, tmp_path):
    for straight, resumed in dist_pools.run(2, _save_then_resume, data_path, str(tmp_path)):
        assert len(resumed) == 4 and resumed == pytest.approx(straight, abs=1e-6)
