"""Mixture of experts on gloo ranks, against one process:
- expert-parallel dispatch with a router forced onto one rank's experts: the same
  outputs and gradients as the single-process layer, no rank skipping a collective;
- the trainer on every layout (ep over dp and cp, every ZeRO stage, tp with and
  without sp, pipelines with and without ep), with the balancing loss and the bias
  updates on, gives the single-process losses and gradient norms step by step;
- a run saved at one ep degree resumes at another.
"""

import copy

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(240)

CFG = dict(
    n_layer=2,
    d_model=16,
    n_head=2,
    n_kv_head=1,
    ffn_hidden_size=32,
    vocab_size=64,
    n_experts=4,
    experts_per_token=2,
    moe_ffn_hidden_size=8,
)


def _forced_dispatch(ep: int):
    """A layer whose routing bias sends every token to experts 0 and 1 (rank 0's):
    the other ranks receive nothing and still take part in every collective."""
    from meshwise.apply.experts import ExpertParallelExperts
    from meshwise.comm import ops
    from meshwise.mesh import Mesh, ParallelDims
    from meshwise.models.llama import Llama, LlamaConfig

    mesh = Mesh.build(ParallelDims(dp=ep, ep=ep))
    cfg = LlamaConfig(**CFG, bias_update_rate=0.1)
    whole = Llama(cfg).init_weights(5).layers["0"].mlp
    whole.expert_bias.data = torch.tensor([10.0, 10.0, 0.0, 0.0])
    x = torch.randn(2, 6, cfg.d_model, generator=torch.Generator().manual_seed(mesh.rank))
    grad = torch.randn(2, 6, cfg.d_model, generator=torch.Generator().manual_seed(9))
    want = whole(x)
    want.backward(grad)
    split = ExpertParallelExperts(whole.experts, mesh.ep_group)
    rows = slice(mesh.ep_group.rank * split.local, (mesh.ep_group.rank + 1) * split.local)
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(split, name).data = getattr(whole.experts, name).data[rows].clone()
    local = copy.deepcopy(whole)  # the same layer with this rank's experts
    local.experts = split
    local.zero_grad()
    got = local(x)
    got.backward(grad)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(local.gate.weight.grad, whole.gate.weight.grad)
    for name in ("gate_proj", "up_proj", "down_proj"):
        # this rank's experts' gradients come from every rank's tokens
        every = getattr(whole.experts, name).grad.clone()
        ops.all_reduce(every, mesh.dp_group)
        torch.testing.assert_close(getattr(split, name).grad, every[rows], atol=1e-6, rtol=1e-5)
    return [int(n) for n in split.gate_proj.grad.flatten().ne(0).sum().reshape(1)]


def test_forced_routing_leaves_a_rank_without_tokens_and_nothing_hangs(dist_pools):
    nonzero = dist_pools.run(2, _forced_dispatch, 2)
    assert nonzero[0][0] > 0 and nonzero[1][0] == 0  # rank 1's experts got no token


# ---------------------------------------------------------------- the trainer
STEPS = 6
MOE = dict(
    preset="llama-tiny",
    n_layer=2,
    d_model=32,
    n_head=2,
    n_kv_head=2,
    ffn_hidden_size=32,
    n_experts=4,
    moe_ffn_hidden_size=16,
    shared_expert_size=16,
    aux_loss_coef=0.01,
    bias_update_rate=0.01,
)
# The balancing loss is over each global micro-batch: layouts with one per step match
# one process; a pipeline's two match one process accumulating two.
LAYOUTS = {
    "dp2 ep2": dict(dp=2, ep=2),
    "dp2 ep2 zero3": dict(dp=2, ep=2, zero=3),
    "dp4 ep2 zero1": dict(dp=4, ep=2, zero=1),
    "tp2": dict(tp=2),
    "dp2 ep2 tp2 sp zero2": dict(dp=2, ep=2, tp=2, sp=True, zero=2),
    "cp2 ep2": dict(cp=2, ep=2),
    "pp2": dict(pp=2),
    "dp2 ep2 pp2 checkpointing": dict(dp=2, ep=2, pp=2, activation_checkpointing="full"),
    # stage 0 holds a dense layer only: no expert engine there, no router statistics
    "dp2 ep2 pp2 zero3 dense first stage": dict(dp=2, ep=2, pp=2, zero=3),
    # bf16 compute (fp32 routing): other summation orders, agreement to bf16 round-off
    "dp2 ep2 zero2 bf16": dict(dp=2, ep=2, zero=2, dtype="bf16"),
    # hybrid sharding: experts shard within a replica and replicate across, every
    # replica bitwise equal after every step
    "dp4 shard2 ep2 zero1": dict(dp=4, dp_shard=2, ep=2, zero=1, check_replicas_every=1),
    "dp4 shard2 ep2 zero3": dict(dp=4, dp_shard=2, ep=2, zero=3, check_replicas_every=1),
}
MODEL_OF = {"dp2 ep2 pp2 zero3 dense first stage": {"first_dense_layers": 1}}
ACCUMULATE = {"pp2": 2}
# A pipeline with ep spreads each global micro-batch over dp ranks: compared without
# the balancing loss (whose micro-batches differ from one process's), bias updates on.
WITHOUT_AUX = {"dp2 ep2 pp2 checkpointing", "dp2 ep2 pp2 zero3 dense first stage"}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    # Its own draw (the bf16 cases' tolerance was set on these batches), not conftest's
    path = tmp_path_factory.mktemp("moe") / "tokens.bin"
    np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint16).tofile(path)
    return str(path)


def _config(model: dict, layout: dict, data_path: str):
    from meshwise.train.config import TrainConfig

    cfg = TrainConfig()
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, 16, 4
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, 3e-3
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    for key, value in layout.items():
        section = next(
            s for s in (cfg.runtime, cfg.parallel, cfg.data, cfg.checkpoint) if hasattr(s, key)
        )
        setattr(section, key, value)
    return cfg.validate()


def _train(model: dict, layout: dict, data_path: str, stop=STEPS):
    """Steps up to ``stop`` of a ``STEPS``-step run (saved there with ``save``)."""
    from meshwise.train.trainer import Trainer

    cfg = _config(model, layout, data_path)
    trainer = Trainer(cfg, data_path, layout.get("resume"))
    records = [trainer.train_step(step) for step in range(trainer.start_step + 1, stop + 1)]
    if layout.get("save"):
        trainer.checkpointer.save(stop)
    trainer.comm_stats.close()
    return [(r["loss"], r["grad_norm"], r["aux_loss"], r["moe_max_load"]) for r in records]


def _world(layout: dict) -> int:
    return int(np.prod([layout.get(axis, 1) for axis in ("dp", "tp", "pp", "cp")]))


_REFERENCES: dict = {}


def _reference(dist_pools, model: dict, accumulate: int, data_path: str, dtype="fp32"):
    key = (tuple(sorted(model.items())), accumulate, dtype)
    if key not in _REFERENCES:
        layout = {"grad_accum": accumulate, "dtype": dtype}
        _REFERENCES[key] = dist_pools.run(1, _train, model, layout, data_path)[0]
    return _REFERENCES[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_trains_as_one_process(dist_pools, tokens, name):
    layout = LAYOUTS[name]
    model = {**MOE, **MODEL_OF.get(name, {})}
    if name in WITHOUT_AUX:
        model["aux_loss_coef"] = 0.0
    dtype = layout.get("dtype", "fp32")
    expected = _reference(dist_pools, model, ACCUMULATE.get(name, 1), tokens, dtype)
    got = dist_pools.run(_world(layout), _train, model, layout, tokens)[0]
    for step, (row, ref) in enumerate(zip(got, expected, strict=True), 1):
        assert row == pytest.approx(ref, rel=1e-4 if dtype == "fp32" else 1e-2), (name, step)


def test_balancing_changes_the_routing(dist_pools, tokens):
    """The balancing loss's gradient reaches the router and the biases move: each
    option changes the curve (a loss that never reached the router would not)."""
    plain = {**MOE, "aux_loss_coef": 0.0, "bias_update_rate": 0.0}
    curves = [
        dist_pools.run(1, _train, model, {}, tokens)[0]
        for model in (plain, {**plain, "aux_loss_coef": 0.5}, {**plain, "bias_update_rate": 0.05})
    ]
    assert curves[0][-1][0] != curves[1][-1][0] and curves[0][-1][0] != curves[2][-1][0]
    assert curves[0][1][3] != curves[2][1][3]  # the load at step 2 follows the biases


def _biases_around_a_skipped_step(data_path: str):
    """The routing biases after each of 3 steps when step 2's loss is NaN (--on-nan skip)."""
    from meshwise.geometry.flat_runs import owned_values
    from meshwise.train.trainer import Trainer

    cfg = _config(MOE, {}, data_path)
    cfg.optim.on_nan = "skip"
    trainer = Trainer(cfg, data_path)
    trainer.after_loss.append(lambda step, loss: loss * float("nan") if step == 2 else loss)
    biases = []
    for step in (1, 2, 3):
        trainer.train_step(step)
        held = owned_values(trainer.engine.checkpoint_runs())
        biases.append(held["layers.0.mlp.expert_bias"].clone())
    trainer.comm_stats.close()
    return biases


def test_a_skipped_step_moves_no_routing_bias(dist_pools, tokens):
    after_1, after_2, after_3 = dist_pools.run(1, _biases_around_a_skipped_step, tokens)[0]
    assert after_1.abs().sum() > 0  # the biases do move on a step taken
    assert torch.equal(after_1, after_2)  # not on the skipped one
    assert not torch.equal(after_2, after_3)


def test_resume_across_ep_degrees(dist_pools, tokens, tmp_path):
    """Saved at ep 2 (experts split over two ranks), resumed at ep 1 and at ep 2 on a
    dp x cp of another shape: the uninterrupted run's losses."""
    whole = _reference(dist_pools, MOE, 1, tokens)
    save = tmp_path / "run"
    save.mkdir()
    save = str(save)
    dist_pools.run(2, _train, MOE, dict(dp=2, ep=2, save=save), tokens, 3)
    checkpoint = str(next((tmp_path / "run").rglob("manifest.json")).parent)
    # generate and export read the whole expert tensors, gathered from both ranks
    from meshwise.checkpoint.store import Checkpoint
    from meshwise.serve.model import load_model

    experts = load_model(Checkpoint(checkpoint)).layers["0"].mlp.experts
    assert experts.gate_proj.shape == (MOE["n_experts"], 16, 32)
    assert experts.gate_proj[:2].abs().sum() > 0 and experts.gate_proj[2:].abs().sum() > 0
    for layout in (dict(dp=2), dict(dp=4, ep=4, zero=2)):
        resumed = dist_pools.run(
            _world(layout), _train, MOE, {**layout, "resume": checkpoint}, tokens
        )[0]
        for row, ref in zip(resumed, whole[3:], strict=True):
            assert row == pytest.approx(ref, rel=1e-4), layout


def _state_bytes(model: dict, layout: dict, data_path: str) -> int:
    from meshwise.train.trainer import Trainer

    trainer = Trainer(_config(model, layout, data_path), data_path)
    trainer.comm_stats.close()
    return trainer.engine.state_bytes()


def test_expert_state_per_rank_falls_as_one_over_ep(dist_pools, tokens):
    """Parameters, gradients and AdamW moments a rank keeps (the engines' own count):
    the dense part stays, the experts' part is 1/ep of the whole."""
    model = {**MOE, "d_model": 64, "moe_ffn_hidden_size": 64, "n_experts": 8}
    held = {
        ep: dist_pools.run(4, _state_bytes, model, dict(dp=4, ep=ep), tokens)[0] for ep in (1, 2, 4)
    }
    experts = 2 * 8 * 3 * 64 * 64 * 4 * 4  # layers x experts x matrices x fp32 x 4 states
    assert held[1] - held[2] == pytest.approx(experts / 2, rel=0.01)
    assert held[1] - held[4] == pytest.approx(experts * 3 / 4, rel=0.01)


@pytest.mark.parametrize("ep, reads", [(1, 1), (2, 3)])
def test_host_reads_one_per_step_and_one_per_expert_parallel_layer(dist_pools, tokens, ep, reads):
    """The step's metrics read, plus, under ep, one read of the token counts per MoE
    layer and micro-batch (2 layers, 1 micro-batch); routing, the balancing loss and
    the bias updates read nothing."""
    from tests.dist.test_host_syncs import _reads_in_one_step

    layout = dict(
        preset="llama-tiny",
        n_kv_head=2,
        ffn_hidden_size=32,
        n_experts=4,
        moe_ffn_hidden_size=16,
        aux_loss_coef=0.01,
        bias_update_rate=0.01,
        dp=2,
        ep=ep,
    )
    for got in dist_pools.run(2, _reads_in_one_step, layout, tokens):
        assert got == ["tolist"] * reads, got
