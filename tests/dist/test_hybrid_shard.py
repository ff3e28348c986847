"""Hybrid sharding (--dp-shard) on gloo ranks, against one process:
- ZeRO 1-3 within replicas of 2 dp ranks, replicas all-reducing their shards, with tp
  and with a pipeline: the single-process losses and gradient norms step by step over
  20 steps (the norm counts each shard once), every replica bitwise equal after every
  step;
- bf16, cp, and the cross-replica sum through the ring and tree algorithms and the fp16
  and PowerSGD compressors, over 5 steps;
- a run saved with --dp-shard 2 resumes with another --dp-shard, and a PowerSGD one on
  the same layout bit-exactly.
"""

import numpy as np
import pytest

pytestmark = pytest.mark.timeout(240)

STEPS = 20  # the learning-rate schedule's length; most layouts stop after SHORT
SHORT = 5
MODEL = dict(preset="tiny", n_layer=2, d_model=16, n_head=2)
LAYOUTS = {
    "dp4 shard2 zero1": dict(dp=4, dp_shard=2, zero=1),
    "dp4 shard2 zero2": dict(dp=4, dp_shard=2, zero=2),
    "dp4 shard2 zero3": dict(dp=4, dp_shard=2, zero=3),
    "dp4 shard2 tp2 zero3": dict(dp=4, dp_shard=2, tp=2, zero=3),
    "dp4 shard2 pp2 zero2": dict(dp=4, dp_shard=2, pp=2, zero=2),
    "dp4 shard2 pp2 zero3": dict(dp=4, dp_shard=2, pp=2, zero=3),
    "dp2 shard1 cp2 zero3": dict(dp=2, dp_shard=1, cp=2, zero=3),
    # bf16 compute, fp32 masters: other summation orders, agreement to bf16 round-off
    "dp4 shard2 zero2 bf16": dict(dp=4, dp_shard=2, zero=2, dtype="bf16"),
    # the cross-replica sum through our algorithms (exact), and a lossy compressor
    "dp4 shard2 zero2 ring": dict(dp=4, dp_shard=2, zero=2, allreduce="ring"),
    "dp4 shard2 tp2 zero3 tree": dict(dp=4, dp_shard=2, tp=2, zero=3, allreduce="tree"),
    "dp4 shard2 zero3 fp16": dict(dp=4, dp_shard=2, zero=3, compress="fp16"),
}
# All STEPS steps at each ZeRO stage, with tp and with a pipeline (replicas could drift
# slowly); the variations on them stop after SHORT.
LONG = {
    "dp4 shard2 zero1",
    "dp4 shard2 zero2",
    "dp4 shard2 zero3",
    "dp4 shard2 tp2 zero3",
    "dp4 shard2 pp2 zero3",
}
# Relative tolerance per step against one process: fp32 round-off, unless bf16 compute
# or fp16 gradients across the replicas (2^-11 relative each, clipped updates).
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-3}


def _config(layout: dict, data_path: str):
    from meshwise.train.config import TrainConfig

    cfg = TrainConfig()
    for key, value in MODEL.items():
        setattr(cfg.model, key, value)
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, 16, 8
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, 3e-3
    cfg.optim.clip = 0.05  # clipped every step: a wrong norm would change the update
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    cfg.runtime.check_replicas_every = 1  # replicas bitwise equal after every step
    for key, value in layout.items():
        section = next(
            s
            for s in (cfg.runtime, cfg.parallel, cfg.data, cfg.checkpoint, cfg.comm)
            if hasattr(s, key)
        )
        setattr(section, key, value)
    return cfg.validate()


def _train(layout: dict, data_path: str, stop=STEPS):
    """Steps up to ``stop`` of a ``STEPS``-step run (saved there with ``save``)."""
    from meshwise.train.trainer import Trainer

    trainer = Trainer(_config(layout, data_path), data_path, layout.get("resume"))
    if trainer.mesh.replicate_group is not None:  # the groups are what they say
        assert trainer.engine.group.size == layout["dp_shard"] * layout.get("cp", 1)
    records = [trainer.train_step(step) for step in range(trainer.start_step + 1, stop + 1)]
    if layout.get("save"):
        trainer.checkpointer.save(stop)
    trainer.comm_stats.close()
    return [(r["loss"], r["grad_norm"]) for r in records]


def _world(layout: dict) -> int:
    return int(np.prod([layout.get(axis, 1) for axis in ("dp", "tp", "pp", "cp")]))


_REFERENCES: dict = {}


def _reference(dist_pools, data_path: str, dtype: str = "fp32"):
    if dtype not in _REFERENCES:
        _REFERENCES[dtype] = dist_pools.run(1, _train, {"dtype": dtype}, data_path)[0]
    return _REFERENCES[dtype]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_hybrid_sharding_trains_as_one_process(dist_pools, tokens, name):
    layout = LAYOUTS[name]
    dtype = layout.get("dtype", "fp32")
    expected = _reference(dist_pools, tokens, dtype)
    stop = STEPS if name in LONG else SHORT
    got = dist_pools.run(_world(layout), _train, layout, tokens, stop)[0]
    rel = next((tol for key, tol in TOLERANCE.items() if name.endswith(key)), 1e-4)
    for step, (row, ref) in enumerate(zip(got, expected[:stop], strict=True), 1):
        assert row == pytest.approx(ref, rel=rel), (name, step)


def test_powersgd_across_replicas_is_powersgd_over_dp(dist_pools, tokens, tmp_path):
    """PowerSGD is linear in the summed gradient (P = sum M_i Q, Q' = sum M_i^T P^), and so
    is its error feedback: at ZeRO-1, compressing the replicas' sums equals compressing
    every rank's gradient over the whole dp group, to round-off (a lossy reference). A
    run saved at step 3 resumes bit-exactly, error feedback and Q included."""
    compressed = dict(dp=4, zero=1, compress="powersgd:1", compress_warmup_steps=1)
    whole = dist_pools.run(4, _train, compressed, tokens, SHORT)[0]
    hybrid = dist_pools.run(4, _train, {**compressed, "dp_shard": 2}, tokens, SHORT)[0]
    norms = [norm for _, norm in _reference(dist_pools, tokens)[:SHORT]]
    assert [norm for _, norm in whole] != pytest.approx(norms, rel=1e-2)  # it compressed
    for step, (row, ref) in enumerate(zip(hybrid, whole, strict=True), 1):
        assert row == pytest.approx(ref, rel=1e-4), step
    layout = {**compressed, "dp_shard": 2}
    dist_pools.run(4, _train, {**layout, "save": str(tmp_path)}, tokens, 3)
    checkpoint = str(next(tmp_path.rglob("manifest.json")).parent)
    resumed = dist_pools.run(4, _train, {**layout, "resume": checkpoint}, tokens, SHORT)[0]
    assert resumed == hybrid[3:SHORT]


def test_resume_across_dp_shard(dist_pools, tokens, tmp_path):
    """Saved with two replicas of 2 (the first replica writes), resumed with one replica
    of 4 and with four of 1: the uninterrupted run's losses."""
    whole = _reference(dist_pools, tokens)
    save = str(tmp_path)
    dist_pools.run(4, _train, dict(dp=4, dp_shard=2, zero=3, save=save), tokens, 3)
    checkpoint = str(next(tmp_path.rglob("manifest.json")).parent)
    for layout in (dict(dp=4, zero=3), dict(dp=4, dp_shard=1, zero=2)):
        resumed = dist_pools.run(4, _train, {**layout, "resume": checkpoint}, tokens, SHORT)[0]
        for row, ref in zip(resumed, whole[3:SHORT], strict=True):
            assert row == pytest.approx(ref, rel=1e-4), layout
