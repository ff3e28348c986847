"""Parity of the tensor-parallel layers against single-process PyTorch, in float64.

Each check runs on 2 gloo ranks (tp=2): every rank builds the unsharded
reference from the same seed, runs the same data through both, and compares
outputs, input gradients and its own slice of every parameter gradient.
"""

import types

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from meshwise.geometry.params import is_tp_sharded
from meshwise.mesh import Mesh, ParallelDims
from meshwise.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    padded_vocab_size,
)
from meshwise.tensor_parallel.mappings import gather_from_tp, scatter_to_tp
from meshwise.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
)

DT = torch.float64
TOL = dict(rtol=1e-12, atol=1e-13)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, **TOL, msg=lambda m: f"{what}: {m}")


def _tp_group(tp=2, dp=1):
    return Mesh.build(ParallelDims(dp=dp, tp=tp)).tp_group


def _chunk(t, group, dim):
    """This rank's slice of the full tensor ``t`` along ``dim``."""
    return t.chunk(group.size, dim=dim)[group.rank]


def _reference_linear(layer_cls, fin, fout, seed, **kw):
    """nn.Linear holding the full parameters the tp layer starts from (tp_group=None)."""
    full = layer_cls(fin, fout, None, init_seed=seed, init_std=0.5, dtype=DT, **kw)
    ref = nn.Linear(fin, fout, dtype=DT)
    with torch.no_grad():
        ref.weight.copy_(full.weight)
        ref.bias.copy_(_inputs(fout, seed=seed))  # non-zero bias exercises the bias path
    return ref


def _inputs(*shape, seed=1):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=DT)


# ---------------------------------------------------------------- rank functions
def _check_mappings():
    g = _tp_group()
    x = _inputs(4, 8, 6).requires_grad_()
    gy = _inputs(4, 8, 6, seed=2)
    for dim in (0, 1, 2, -1):
        local = scatter_to_tp(x, g, dim=dim)
        _close(local, _chunk(x.detach(), g, dim), f"scatter dim {dim}")
        full = gather_from_tp(local * 3.0, g, dim=dim)
        _close(full, 3.0 * x.detach(), f"gather dim {dim}")
        x.grad = None
        full.backward(gy)
        _close(x.grad, 3.0 * gy, f"scatter/gather backward dim {dim}")


def _check_column(gather_output):
    g = _tp_group()
    ref = _reference_linear(ColumnParallelLinear, 6, 8, seed=3)
    layer = ColumnParallelLinear(6, 8, g, gather_output=gather_output, init_seed=3,
                                 init_std=0.5, dtype=DT)
    with torch.no_grad():
        layer.bias.copy_(_chunk(ref.bias, g, 0))
    _close(layer.weight, _chunk(ref.weight, g, 0), "init is a slice of the full weight")
    x = _inputs(4, 3, 6).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    gy = _inputs(4, 3, 8, seed=2)
    y, y_ref = layer(x), ref(x_ref)
    y_ref.backward(gy)
    if gather_output:
        _close(y, y_ref, "gathered output")
        y.backward(gy)
    else:
        _close(y, _chunk(y_ref, g, -1), "output shard")
        y.backward(_chunk(gy, g, -1))
    _close(x.grad, x_ref.grad, "input grad")
    _close(layer.weight.grad, _chunk(ref.weight.grad, g, 0), "weight grad shard")
    _close(layer.bias.grad, _chunk(ref.bias.grad, g, 0), "bias grad shard")
    assert layer.weight.tp_sharded and layer.weight.tp_dim == 0
    assert layer.bias.tp_sharded and layer.bias.tp_dim == 0


def _check_row(input_is_parallel):
    g = _tp_group()
    ref = _reference_linear(RowParallelLinear, 8, 6, seed=4)
    layer = RowParallelLinear(8, 6, g, input_is_parallel=input_is_parallel, init_seed=4,
                              init_std=0.5, dtype=DT)
    with torch.no_grad():
        layer.bias.copy_(ref.bias)
    _close(layer.weight, _chunk(ref.weight, g, 1), "init is a slice of the full weight")
    x_full = _inputs(4, 3, 8)
    x = (_chunk(x_full, g, -1) if input_is_parallel else x_full).clone().requires_grad_()
    x_ref = x_full.clone().requires_grad_()
    gy = _inputs(4, 3, 6, seed=2)
    y, y_ref = layer(x), ref(x_ref)
    _close(y, y_ref, "output")
    y.backward(gy)
    y_ref.backward(gy)
    _close(x.grad, _chunk(x_ref.grad, g, -1) if input_is_parallel else x_ref.grad, "input grad")
    _close(layer.weight.grad, _chunk(ref.weight.grad, g, 1), "weight grad shard")
    _close(layer.bias.grad, ref.bias.grad, "replicated bias grad")
    assert layer.weight.tp_sharded and layer.weight.tp_dim == 1
    assert not layer.bias.tp_sharded and layer.bias.tp_dim is None


def _check_mlp():
    """Megatron's MLP: column (no gather) -> GELU -> row (parallel input), section 3."""
    g = _tp_group()
    fc1_ref = _reference_linear(ColumnParallelLinear, 8, 16, seed=5)
    fc2_ref = _reference_linear(RowParallelLinear, 16, 8, seed=6)
    fc1 = ColumnParallelLinear(8, 16, g, init_seed=5, init_std=0.5, dtype=DT)
    fc2 = RowParallelLinear(16, 8, g, init_seed=6, init_std=0.5, dtype=DT)
    with torch.no_grad():
        fc1.bias.copy_(_chunk(fc1_ref.bias, g, 0))
        fc2.bias.copy_(fc2_ref.bias)
    x = _inputs(2, 5, 8).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    y = fc2(F.gelu(fc1(x)))
    y_ref = fc2_ref(F.gelu(fc1_ref(x_ref)))
    _close(y, y_ref, "mlp output")
    (y * y).sum().backward()
    (y_ref * y_ref).sum().backward()
    _close(x.grad, x_ref.grad, "mlp input grad")
    _close(fc1.weight.grad, _chunk(fc1_ref.weight.grad, g, 0), "fc1 weight grad")
    _close(fc1.bias.grad, _chunk(fc1_ref.bias.grad, g, 0), "fc1 bias grad")
    _close(fc2.weight.grad, _chunk(fc2_ref.weight.grad, g, 1), "fc2 weight grad")
    _close(fc2.bias.grad, fc2_ref.bias.grad, "fc2 bias grad")


def _tied_head(emb, group):
    """The output layer sharing the embedding's table (a tied head)."""
    head = VocabParallelHead(emb.embedding_dim, emb.num_embeddings, group, dtype=DT)
    head.weight = emb.weight
    return head


def _padded_ref_weight(emb_ref, g):
    """The reference table padded with zero rows like the tp layout."""
    padded = padded_vocab_size(emb_ref.num_embeddings, g.size)
    full = torch.zeros(padded, emb_ref.embedding_dim, dtype=DT)
    full[:emb_ref.num_embeddings] = emb_ref.weight.detach()
    return full


def _check_embedding_and_loss(vocab, tp):
    """Embedding lookup, tied LM head and vocab-parallel loss vs the plain modules."""
    g = _tp_group(tp)
    dim, ignore = 6, -100
    single = VocabParallelEmbedding(vocab, dim, None, init_seed=7, init_std=0.5, dtype=DT)
    emb_ref = nn.Embedding(vocab, dim, dtype=DT)
    with torch.no_grad():
        emb_ref.weight.copy_(single.weight)
    emb = VocabParallelEmbedding(vocab, dim, g, init_seed=7, init_std=0.5, dtype=DT)
    rows = emb.weight.shape[0]
    assert rows * g.size == padded_vocab_size(vocab, g.size)
    _close(emb.weight, _chunk(_padded_ref_weight(emb_ref, g), g, 0), "init slice (zero padding)")

    gen = torch.Generator().manual_seed(8)
    ids = torch.randint(0, vocab, (3, 7), generator=gen)
    ids[0, :4] = torch.tensor([0, rows - 1, rows, vocab - 1])  # both sides of the split
    targets = torch.randint(0, vocab, (3, 7), generator=gen)
    targets[1, 2] = targets[2, 5] = ignore
    targets[0, :3] = torch.tensor([rows - 1, rows, vocab - 1])

    h, h_ref = emb(ids), emb_ref(ids)
    _close(h, h_ref, "embedding output")
    h, h_ref = torch.tanh(h), torch.tanh(h_ref)  # something between lookup and head
    head = _tied_head(emb, g)
    logits = head(h)
    logits_ref = h_ref @ emb_ref.weight.t()
    _close(logits, _chunk(F.pad(logits_ref, (0, rows * g.size - vocab)), g, -1), "logit shard")
    _close(head.full_logits(logits), logits_ref, "gathered logits")
    loss = vocab_parallel_cross_entropy(logits, targets, g, vocab_size=vocab, ignore_index=ignore)
    loss_ref = F.cross_entropy(logits_ref.reshape(-1, vocab), targets.reshape(-1),
                               ignore_index=ignore, reduction="sum")
    _close(loss, loss_ref, "sum loss")
    loss.backward()
    loss_ref.backward()
    grad_ref = F.pad(emb_ref.weight.grad, (0, 0, 0, rows * g.size - vocab))
    _close(emb.weight.grad, _chunk(grad_ref, g, 0), "tied embedding grad (padding rows zero)")


def _check_cross_entropy_padding_and_reductions(tp):
    """Garbage in the padding columns must not change the loss or get a gradient."""
    g = _tp_group(tp)
    vocab, ignore = 257, -100
    width = padded_vocab_size(vocab, g.size) // g.size
    logits_full = _inputs(4, 5, vocab, seed=9) * 4.0
    padded = F.pad(logits_full, (0, width * g.size - vocab), value=1e4)  # huge: would dominate
    targets = torch.randint(0, vocab, (4, 5), generator=torch.Generator().manual_seed(10))
    targets[3, :2] = ignore
    targets[0, 0] = vocab - 1
    for reduction in ("none", "sum", "mean"):
        shard = _chunk(padded, g, -1).clone().requires_grad_()
        ref_in = logits_full.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, targets, g, vocab_size=vocab,
                                            ignore_index=ignore, reduction=reduction)
        ref = F.cross_entropy(ref_in.reshape(-1, vocab), targets.reshape(-1),
                              ignore_index=ignore, reduction=reduction)
        ref = ref.view(targets.shape) if reduction == "none" else ref
        _close(loss, ref, f"loss ({reduction})")
        gl = _inputs(*loss.shape, seed=11)
        loss.backward(gl)
        ref.backward(gl)
        grad_ref = F.pad(ref_in.grad, (0, width * g.size - vocab))
        _close(shard.grad, _chunk(grad_ref, g, -1), f"logit grad ({reduction})")


def _check_tp_size_one_is_plain_pytorch():
    """A tp group of size 1 (dp=2, tp=1) must add no communication and no re-association."""
    g = _tp_group(tp=1, dp=2)
    assert g.size == 1
    _check_identical_to_plain(g)
    return g.counters.bytes_sent.get("tp", 0.0)


def _check_identical_to_plain(group):
    x = _inputs(3, 6).requires_grad_()
    col = ColumnParallelLinear(6, 4, group, gather_output=True, init_seed=1, dtype=DT)
    row = RowParallelLinear(4, 6, group, input_is_parallel=False, init_seed=2, dtype=DT)
    lin1, lin2 = nn.Linear(6, 4, dtype=DT), nn.Linear(4, 6, dtype=DT)
    emb = VocabParallelEmbedding(11, 6, group, init_seed=3, dtype=DT)
    emb_ref = nn.Embedding(11, 6, dtype=DT)
    with torch.no_grad():
        for mine, ref in ((col, lin1), (row, lin2)):
            ref.weight.copy_(mine.weight)
            mine.bias.copy_(_inputs(*ref.bias.shape, seed=5))
            ref.bias.copy_(mine.bias)
        emb_ref.weight.copy_(emb.weight)
    ids = torch.tensor([[0, 3, 10], [7, 7, 1]])
    targets = torch.tensor([[1, -100, 10], [4, 0, 2]])
    x_ref = x.detach().clone().requires_grad_()
    logits = _tied_head(emb, group)(emb(ids))
    out = row(col(x)).sum() + vocab_parallel_cross_entropy(logits, targets, group)
    out_ref = lin2(lin1(x_ref)).sum() + F.cross_entropy(
        (emb_ref(ids) @ emb_ref.weight.t()).reshape(-1, 11), targets.reshape(-1), reduction="sum")
    assert torch.equal(out, out_ref)
    out.backward()
    out_ref.backward()
    assert torch.equal(x.grad, x_ref.grad)
    for mine, ref in ((col, lin1), (row, lin2), (emb, emb_ref)):
        for name, p in mine.named_parameters():
            assert torch.equal(p.grad, getattr(ref, name).grad), name
    # The attributes describe the kind of parameter, whatever the layout.
    assert [(p.tp_sharded, p.tp_dim) for p in (col.weight, col.bias, row.weight, row.bias)] == [
        (True, 0), (True, 0), (True, 1), (False, None)]
    assert emb.weight.tp_sharded and emb.weight.tp_dim == 0 and emb.weight.tp_unpadded_size == 11


# ---------------------------------------------------------------- tests
def test_scatter_gather_along_any_dim(dist_pools):
    dist_pools.run(2, _check_mappings)


@pytest.mark.parametrize("gather_output", [False, True])
def test_column_parallel_linear_matches_nn_linear(dist_pools, gather_output):
    dist_pools.run(2, _check_column, gather_output)


@pytest.mark.parametrize("input_is_parallel", [True, False])
def test_row_parallel_linear_matches_nn_linear(dist_pools, input_is_parallel):
    dist_pools.run(2, _check_row, input_is_parallel)


def test_column_row_mlp_matches_two_linears(dist_pools):
    dist_pools.run(2, _check_mlp)


# (4, 3): the last rank holds only padding rows.
@pytest.mark.parametrize("vocab,tp", [(256, 2), (257, 2), (257, 3), (4, 3)])
def test_embedding_tied_head_and_loss_match_reference(dist_pools, vocab, tp):
    dist_pools.run(tp, _check_embedding_and_loss, vocab, tp)


@pytest.mark.parametrize("tp", [2, 3])
def test_cross_entropy_masks_padding_and_matches_every_reduction(dist_pools, tp):
    dist_pools.run(tp, _check_cross_entropy_padding_and_reductions, tp)


def test_tp_group_of_size_one_is_plain_pytorch(dist_pools):
    assert dist_pools.run(2, _check_tp_size_one_is_plain_pytorch) == [0.0, 0.0]


def test_no_group_is_plain_pytorch():
    _check_identical_to_plain(None)


def test_init_is_layout_independent_and_validated():
    fake = [types.SimpleNamespace(size=3, rank=r) for r in range(3)]
    full = ColumnParallelLinear(5, 6, None, init_seed=11)
    shards = [ColumnParallelLinear(5, 6, g, init_seed=11).weight for g in fake]
    assert torch.equal(torch.cat([s.detach() for s in shards]), full.weight.detach())
    emb = [VocabParallelEmbedding(10, 4, g, init_seed=2).weight.detach() for g in fake]
    assert torch.equal(torch.cat(emb)[:10], VocabParallelEmbedding(10, 4, None, init_seed=2).weight)
    assert torch.all(torch.cat(emb)[10:] == 0) and torch.cat(emb).shape[0] == 12
    assert all(is_tp_sharded(s) and s.tp_dim == 0 for s in shards)
    assert not is_tp_sharded(nn.Linear(2, 2).weight)
    with pytest.raises(ValueError, match="out_features=7"):
        ColumnParallelLinear(4, 7, fake[0])
    with pytest.raises(ValueError, match="in_features=7"):
        RowParallelLinear(7, 4, fake[0])
    with pytest.raises(ValueError, match="reduction"):
        vocab_parallel_cross_entropy(torch.zeros(2, 3), torch.zeros(2, dtype=torch.long), None,
                                     reduction="avg")
