"""Context and sequence parallelism on gloo ranks, against one process.

- ring attention over a real cp group (``ops.batch_p2p`` on gloo, NCCL's rules)
  equals ``F.scaled_dot_product_attention`` of the whole sequence, forward and
  backward, in float64, with grouped-query heads and with keyed dropout;
- the trainer on every new layout (cp, tp + sp, both, with dp and ZeRO-3, with
  a pipeline, the GPT's learned positions and dropout, activation
  checkpointing) gives the single-process losses and gradient norms step by
  step (the correctness invariant, DESIGN section 1).
"""

import pytest
import torch
import torch.nn.functional as F

from meshwise.geometry.sequence import zigzag_slice

pytestmark = pytest.mark.timeout(240)


def _full_inputs(heads: int, kv_heads: int, seq_len: int = 32):
    g = torch.Generator().manual_seed(3)
    q, k, v, dout = (torch.randn(2, n, seq_len, 8, generator=g, dtype=torch.float64)
                     for n in (heads, kv_heads, kv_heads, heads))
    return q, k, v, dout


def _ring_on_gloo(cp: int, heads: int, kv_heads: int, p: float):
    from meshwise.context_parallel.ring import RingAttention
    from meshwise.mesh import Mesh, ParallelDims
    from meshwise.models.context import ForwardContext

    mesh = Mesh.build(ParallelDims(cp=cp))
    context = ForwardContext(seed=7, step=3, first_sample=2)
    ring = RingAttention(mesh.cp_group, p, "blocks.1.attn.weights").train()
    mine = [zigzag_slice(t, 2, mesh.cp_rank, cp).requires_grad_()
            for t in _full_inputs(heads, kv_heads)]
    out = ring(*mine[:3], context=context)
    out.backward(mine[3].detach())
    return [out.detach()] + [t.grad for t in mine[:3]]


def _unzigzag(chunks):
    halves = [c.chunk(2, dim=2) for c in chunks]
    return torch.cat([h[0] for h in halves] + [h[1] for h in reversed(halves)], dim=2)


@pytest.mark.parametrize("cp, heads, kv_heads, p", [(2, 4, 2, 0.0), (4, 4, 1, 0.0),
                                                     (2, 4, 4, 0.25)])
def test_ring_attention_over_gloo_equals_sdpa(dist_pools, cp, heads, kv_heads, p):
    from meshwise.models.attention import ScaledDotProductAttention
    from meshwise.models.context import ForwardContext

    per_rank = dist_pools.run(cp, _ring_on_gloo, cp, heads, kv_heads, p)
    q, k, v, dout = (t.requires_grad_() for t in _full_inputs(heads, kv_heads))
    context = ForwardContext(seed=7, step=3, first_sample=2)
    out = ScaledDotProductAttention(p, "blocks.1.attn.weights").train()(q, k, v,
                                                                      context=context)
    out.backward(dout.detach())
    for i, (name, want) in enumerate(zip(("out", "dq", "dk", "dv"),
                                         (out.detach(), q.grad, k.grad, v.grad))):
        got = _unzigzag([r[i] for r in per_rank])
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12, msg=name)


# ---------------------------------------------------------------- the trainer
STEPS = 3
LLAMA = dict(preset="llama-tiny", n_layer=2, d_model=64, n_head=4, n_kv_head=2,
             ffn_hidden_size=96)
GPT = dict(preset="tiny", n_layer=2, d_model=32, n_head=4)
LAYOUTS = {
    # name: (model, layout and settings)
    "llama cp2": (LLAMA, dict(cp=2)),
    "llama cp4": (LLAMA, dict(cp=4)),
    "llama tp2 sp": (LLAMA, dict(tp=2, sp=True)),
    "llama cp2 tp2 sp": (LLAMA, dict(cp=2, tp=2, sp=True)),
    "llama dp2 cp2 zero3": (LLAMA, dict(dp=2, cp=2, zero=3)),
    "llama cp2 pp2": (LLAMA, dict(cp=2, pp=2)),
    "llama cp2 tp2 sp zero2 checkpointing": (LLAMA, dict(cp=2, tp=2, sp=True, zero=2,
                                                          activation_checkpointing="full")),
    # the window (8 of 32 tokens) masks each ring block by global positions
    "llama cp2 window": ({**LLAMA, "sliding_window": 8}, dict(cp=2)),
    "gpt cp2": (GPT, dict(cp=2)),
    # selective checkpointing keeps the ring's block outputs, which the ring then merges
    "gpt cp2 selective checkpointing": (GPT, dict(cp=2, activation_checkpointing="selective")),
    "gpt cp2 dropout": ({**GPT, "dropout": 0.1}, dict(cp=2)),
    "gpt tp2 sp pp2 dropout checkpointing": ({**GPT, "dropout": 0.1},
                                             dict(tp=2, sp=True, pp=2,
                                                  activation_checkpointing="full")),
    # bf16 compute: layouts sum in other orders, so they agree to bf16 round-off
    "llama cp2 tp2 sp bf16": (LLAMA, dict(cp=2, tp=2, sp=True, dtype="bf16")),
}
# Relative agreement per step: fp32 round-off; bf16's 8-bit mantissa (tests/e2e/test_bf16.py)
TOLERANCE = {"fp32": 1e-5, "bf16": 1e-2}


def _train(model: dict, layout: dict, data_path: str) -> list[tuple[float, float]]:
    from meshwise.train.config import TrainConfig
    from meshwise.train.trainer import Trainer

    cfg = TrainConfig()
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, 32, 4
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, 3e-3
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    for key, value in layout.items():
        section = cfg.runtime if hasattr(cfg.runtime, key) else cfg.parallel
        setattr(section, key, value)
    trainer = Trainer(cfg.validate(), data_path)
    records = [trainer.train_step(step) for step in range(1, STEPS + 1)]
    trainer.comm_stats.close()
    return [(r["loss"], r["grad_norm"]) for r in records]


_REFERENCES: dict = {}


def _reference(dist_pools, model: dict, dtype: str, data_path: str):
    key = (tuple(sorted(model.items())), dtype)
    if key not in _REFERENCES:
        _REFERENCES[key] = dist_pools.run(1, _train, model, {"dtype": dtype}, data_path)[0]
    return _REFERENCES[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_as_one_process(dist_pools, tokens, name):
    model, layout = LAYOUTS[name]
    world = 1
    for axis in ("dp", "tp", "pp", "cp"):
        world *= layout.get(axis, 1)
    dtype = layout.get("dtype", "fp32")
    expected = _reference(dist_pools, model, dtype, tokens)
    got = dist_pools.run(world, _train, model, layout, tokens)[0]
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(got, expected), 1):
        assert loss == pytest.approx(ref_loss, rel=TOLERANCE[dtype]), (name, step)
        assert norm == pytest.approx(ref_norm, rel=TOLERANCE[dtype]), (name, step)
