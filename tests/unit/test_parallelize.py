"""A plan applied to a plain model: which parameters are split how, ties, logical names."""

import types

import pytest
import torch
from torch import nn

from meshwise.apply.parallelize import parallelize
from meshwise.geometry.init import init_values
from meshwise.geometry.pieces import Piece
from meshwise.geometry.plan import ParallelPlan
from meshwise.models.gpt import GPT, GPTConfig, gpt_init, gpt_plan
from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from meshwise.tensor_parallel.vocab import VocabParallelEmbedding, VocabParallelHead

CFG = GPTConfig(n_layer=4, n_head=4, d_model=16, block_size=8, vocab_size=50)


def _tp(rank, size=2):
    return types.SimpleNamespace(rank=rank, size=size)


def _laid_out(tp_rank=0, tp_size=2, cfg=CFG, **pipeline):
    with torch.device("meta"):
        model = GPT(cfg)
    return parallelize(model, gpt_plan(cfg), tp_group=_tp(tp_rank, tp_size), **pipeline)


def test_modules_are_swapped_by_style_and_the_tie_survives():
    chunk = _laid_out().chunks[0]
    block = chunk.blocks["0"]
    assert isinstance(block.attn.qkv, ColumnParallelLinear)
    assert isinstance(block.mlp.proj, RowParallelLinear)
    assert isinstance(chunk.wte, VocabParallelEmbedding)
    assert isinstance(chunk.lm_head, VocabParallelHead)
    assert chunk.lm_head.weight is chunk.wte.weight  # one parameter, re-tied after the swap
    assert isinstance(block.ln1, nn.LayerNorm) and not hasattr(block.ln1.weight, "tp_dim")
    shapes = {n: (tuple(p.shape), getattr(p, "tp_dim", None)) for n, p in chunk.named_parameters()}
    assert shapes["blocks.0.attn.qkv.weight"] == ((24, 16), 0)  # whole heads: 2 of 4
    assert shapes["blocks.0.attn.proj.weight"] == ((16, 8), 1)
    assert shapes["blocks.0.attn.proj.bias"] == ((16,), None)  # replicated, added once
    assert shapes["wte.weight"] == ((25, 16), 0)  # vocabulary 50 split in two
    assert all(p.device.type == "meta" for _, p in chunk.named_parameters())


def test_pieces_and_init_values_are_the_slices_of_the_single_process_tensors():
    seed = 5
    full = dict(GPT(CFG).init_weights(seed).named_parameters())
    for rank in (0, 1):
        parts = _laid_out(rank)
        values = parts.init_values(lambda name: gpt_init(CFG, name), seed)
        for name, param in parts.named_parameters():
            got = values(name, 0, param.numel()).view(param.shape)
            dim = getattr(param, "tp_dim", None)
            expected = full[name] if dim is None else full[name].chunk(2, dim)[rank]
            torch.testing.assert_close(got, expected.detach(), rtol=0, atol=0, msg=name)
        piece = parts.pieces()["blocks.1.mlp.fc.weight"]
        assert piece.box_offsets == (rank * 32, 0) and piece.box_sizes == (32, 16)


def test_vocabulary_padding_rows_are_zero_and_outside_the_logical_tensor():
    cfg = GPTConfig(n_layer=1, n_head=3, d_model=12, block_size=8, vocab_size=50)
    parts = _laid_out(tp_rank=2, tp_size=3, cfg=cfg)  # 50 rows padded to 51: rank 2: 34..50
    values = parts.init_values(lambda name: gpt_init(cfg, name), 0)
    piece = parts.pieces()["wte.weight"]
    assert piece.box_offsets == (34, 0) and piece.box_sizes == (16, 12)
    local = values("wte.weight", 0, 17 * 12).view(17, 12)
    assert not local[16].any()
    expected = init_values(gpt_init(cfg, "wte.weight"), 0, Piece.whole("wte.weight", (50, 12)))
    torch.testing.assert_close(local[:16], expected.view(50, 12)[34:], rtol=0, atol=0)


def test_pipeline_stages_keep_their_layers_and_name_the_tie_to_sync():
    first = _laid_out(tp_size=1, pp_rank=0, pp_size=2)
    last = _laid_out(tp_size=1, pp_rank=1, pp_size=2)
    assert first.cross_stage_ties == ["wte.weight"] and last.cross_stage_ties == ["lm_head.weight"]
    assert first.is_writer("wte.weight") and not last.is_writer("lm_head.weight")
    assert last.pieces()["lm_head.weight"].name == "wte.weight"  # stored once, as the embedding
    interleaved = _laid_out(tp_size=1, pp_rank=1, pp_size=2, virtual_stages=2)
    assert interleaved.stages == [1, 3]
    assert [list(c.blocks.keys()) for c in interleaved.chunks] == [["1"], ["3"]]


def test_bad_plans_and_cuts_are_refused():
    with pytest.raises(ValueError, match="style 'diagonal'"):
        ParallelPlan(layers="blocks", tp=(("x", "diagonal"),))
    with pytest.raises(ValueError, match="4 layers do not split into pp x virtual stages"):
        _laid_out(tp_size=1, pp_rank=0, pp_size=3)
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="has no attribute 'blocks' .*; its children: 0"):
        parallelize(model, ParallelPlan(layers="blocks"))
    with pytest.raises(ValueError, match=r"Sequential.0 is a Linear; valid: an nn.ModuleList"):
        parallelize(model, ParallelPlan(layers="0"))


class ListLM(nn.Module):
    """A model of one's own in the usual PyTorch form: its layers an ``nn.ModuleList``."""

    def __init__(self, num_layers: int = 4, width: int = 8):
        super().__init__()
        self.embed = nn.Linear(width, width)
        self.blocks = nn.ModuleList(nn.Linear(width, width) for _ in range(num_layers))
        self.head = nn.Linear(width, width)

    def forward(self, x):
        x = self.embed(x) if self.embed is not None else x
        for block in self.blocks:
            x = torch.relu(block(x))
        return self.head(x) if self.head is not None else x


def test_a_module_list_of_layers_is_cut_into_stages_that_keep_their_indices():
    plan = ParallelPlan(layers="blocks", first_stage=("embed",), last_stage=("head",))
    whole = ListLM()
    stages = []
    for rank in (0, 1):
        pm = parallelize(
            ListLM(), plan, pp_rank=rank, pp_size=2, virtual_stages=1, check_forward=True
        )
        pm.chunks[0].load_state_dict(whole.state_dict(), strict=False)
        stages.append(pm)
    second = stages[1].chunks[0]
    assert [n for n, _ in second.named_parameters()] == [
        f"blocks.{i}.{w}" for i in (2, 3) for w in ("weight", "bias")
    ] + ["head.weight", "head.bias"]
    assert len(stages[1].layers()) == 2 and second.blocks[-1] is second.blocks[1]
    x = torch.randn(3, 8)
    torch.testing.assert_close(second(stages[0].chunks[0](x)), whole(x), rtol=0, atol=0)


def test_sequence_and_context_parallel_swap_what_the_plan_names():
    from meshwise.context_parallel.ring import RingAttention
    from meshwise.geometry.sequence import SequenceShard
    from meshwise.tensor_parallel.sequence import SequenceParallelEmbedding

    with torch.device("meta"):
        model = GPT(CFG)
    pm = parallelize(model, gpt_plan(CFG), tp_group=_tp(1), cp_group=_tp(1), sequence_parallel=True)
    chunk = pm.chunks[0]
    assert pm.sequence_parallel
    assert chunk.positions.tokens == SequenceShard(cp_rank=1, cp_size=2)
    assert chunk.positions(0, 4, "cpu").tolist() == [2, 3, 4, 5]  # chunks 1 and 2 of 4
    assert all(isinstance(b.attn.sdpa, RingAttention) for b in chunk.blocks.values())
    assert isinstance(chunk.wpe, SequenceParallelEmbedding)
    gather = chunk.blocks["0"].attn.qkv.sequence
    assert gather is not None and chunk.blocks["1"].mlp.fc.sequence is gather  # one per chunk
    assert chunk.lm_head.sequence is gather and chunk.wte.sequence_parallel
    assert chunk.blocks["0"].mlp.proj.sequence_parallel
    # without context parallelism the model keeps its own positions and attention
    with torch.device("meta"):
        plain = parallelize(GPT(CFG), gpt_plan(CFG), tp_group=_tp(0)).chunks[0]
    assert plain.positions.tokens == SequenceShard() and plain.wpe.__class__ is nn.Embedding


def test_sequence_parallel_needs_tp_and_cp_needs_a_ring():
    import dataclasses

    with torch.device("meta"):
        with pytest.raises(ValueError, match="sequence parallelism .* needs tp > 1"):
            parallelize(GPT(CFG), gpt_plan(CFG), sequence_parallel=True)
        no_ring = dataclasses.replace(gpt_plan(CFG), cp=())
        with pytest.raises(ValueError, match="GPT's plan names no ring_attention"):
            parallelize(GPT(CFG), no_ring, cp_group=_tp(0))
        with pytest.raises(
            ValueError, match="style 'ring' for 'x'; valid: positions, ring_attention"
        ):
            ParallelPlan(layers="blocks", cp=(("x", "ring"),))
