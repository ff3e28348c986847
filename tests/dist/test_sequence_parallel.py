"""Whole models laid out with sequence and context parallelism against one process, float64.

Every rank lays out the GPT (learned positions, biases, LayerNorms, the tied
head) or the Llama (rotary positions, grouped-query attention, RMSNorms) with
``parallelize`` on tp 2 + sp, cp 2, or both, draws its slices of the
layout-independent initial values, feeds its tokens of the same batch, and
compares its logits and every gradient it holds with the single-process
model's: the sequence-parallel layers (gather once into column layers,
reduce-scatter out of row layers, the vocabulary embedding reduce-scattered,
the head gathered, positions looked up per slice) and the ring, exactly.
"""

from functools import partial

import pytest
import torch

from meshwise.comm import ops
from meshwise.geometry.params import is_tp_sharded
from meshwise.geometry.sequence import zigzag_slice

MODELS = {
    "gpt": dict(n_layer=2, n_head=4, d_model=32, block_size=32, vocab_size=67),
    "llama": dict(n_layer=2, n_head=4, n_kv_head=2, d_model=32, ffn_hidden_size=48,
                  block_size=32, vocab_size=67),
}


def _batch(vocab: int):
    ids = torch.randint(0, vocab, (2, 17), generator=torch.Generator().manual_seed(5))
    return ids[:, :-1], ids[:, 1:]  # (2, 16) inputs and targets


def _laid_out_grads(name: str, tp: int, cp: int):
    from meshwise.apply.parallelize import parallelize
    from meshwise.mesh import Mesh, ParallelDims
    from meshwise.models.families import family
    from meshwise.sharding.binding import param_owners, rebind

    mesh = Mesh.build(ParallelDims(tp=tp, cp=cp))
    fam = family(name)
    cfg = fam.make_config(MODELS[name])
    with torch.device("meta"):
        model = fam.build(cfg).double()
    pm = parallelize(model, fam.plan(cfg), tp_group=mesh.tp_group if tp > 1 else None,
                     cp_group=mesh.cp_group, sequence_parallel=tp > 1, vocab_size=cfg.vocab_size)
    values, owners = pm.init_values(partial(fam.init, cfg), seed=0), param_owners(pm.chunks)
    params = {n: rebind(p, values(n, 0, p.numel()).view(p.shape).double(), owners)
              for n, p in pm.named_parameters()}
    inputs, targets = (zigzag_slice(t, 1, mesh.cp_rank, cp) for t in _batch(cfg.vocab_size))
    logits = pm.chunks[0](inputs)  # (2, 16 / cp, V / tp)
    pm.loss(logits, targets).backward()
    grads = {}
    for n, p in params.items():  # the sums GradSync3D makes: over cp, and over tp under sp
        grad = p.grad.clone()
        if cp > 1:
            ops.all_reduce(grad, mesh.cp_group)
        if tp > 1 and not is_tp_sharded(p):
            ops.all_reduce(grad, mesh.tp_group)
        grads[n] = grad
    with torch.no_grad():
        full = pm.full_logits(logits)
    return full, grads, pm.pieces()


def _reference(name: str):
    from meshwise.models.families import family

    fam = family(name)
    cfg = fam.make_config(MODELS[name])
    model = fam.create(cfg, seed=0).double()
    inputs, targets = _batch(cfg.vocab_size)
    logits = model(inputs)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                      reduction="sum").backward()
    return logits.detach(), model


@pytest.mark.parametrize("name", list(MODELS))
@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2), (2, 2)], ids=["tp2-sp", "cp2", "cp2-tp2-sp"])
def test_laid_out_model_gives_the_single_process_logits_and_gradients(dist_pools, name, tp, cp):
    expected_logits, model = _reference(name)
    for rank, (logits, grads, pieces) in enumerate(dist_pools.run(tp * cp, _laid_out_grads,
                                                                  name, tp, cp)):
        cp_rank = rank // tp
        torch.testing.assert_close(logits, zigzag_slice(expected_logits, 1, cp_rank, cp),
                                   rtol=1e-10, atol=1e-12, msg=f"logits, rank {rank}")
        for param_name, grad in grads.items():
            piece = pieces[param_name]
            box = tuple(slice(o, o + s) for o, s in zip(piece.box_offsets, piece.box_sizes))
            want = model.get_parameter(piece.name).grad[box]
            got = grad[tuple(slice(0, s) for s in piece.box_sizes)]  # less vocabulary padding
            torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12,
                                       msg=f"{param_name}, rank {rank}")
