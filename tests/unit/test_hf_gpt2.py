"""A Hugging Face GPT-2 read into meshwise's GPT, slice by slice, computes transformers'
logits; each tensor-parallel box and ZeRO flat range reads its own elements."""

import types

import pytest
import torch

from meshwise.apply.parallelize import parallelize
from meshwise.hf.gpt2 import GPT2Weights, gpt2_sizes
from meshwise.hf.llama import read_config
from meshwise.models.gpt import GPT, GPTConfig, gpt_plan
from tests.hf_llama import ATOL, hf_logits, materialize, save_gpt2, token_ids

pytest.importorskip("transformers")


def _laid_out(directory, tp_rank=0, tp_size=1):
    cfg = GPTConfig(**gpt2_sizes(read_config(directory), str(directory)))
    with torch.device("meta"):
        model = GPT(cfg)
    group = types.SimpleNamespace(rank=tp_rank, size=tp_size)
    pm = parallelize(model, gpt_plan(cfg), tp_group=group if tp_size > 1 else None)
    return pm, pm.values_from(GPT2Weights(directory, cfg.n_head).read)


@pytest.mark.parametrize("prefix", [True, False])
def test_logits_match_transformers(tmp_path, prefix):
    save_gpt2(tmp_path, prefix)
    weights = GPT2Weights(tmp_path, 4)
    weights.files.check(weights.stored_shapes(gpt2_sizes(read_config(tmp_path), "d")))
    pm, values = _laid_out(tmp_path)
    materialize(pm, values)
    ids = token_ids(301)
    with torch.no_grad():
        diff = (pm.chunks[0](ids) - hf_logits(tmp_path, ids)).abs().max().item()
    assert diff <= ATOL, diff


def test_tp_boxes_and_flat_ranges_are_slices_of_the_whole(tmp_path):
    save_gpt2(tmp_path)
    pm, values = _laid_out(tmp_path)
    full = {name: values(name, 0, p.numel()).view(p.shape) for name, p in pm.named_parameters()}
    for rank in (0, 1):
        shard, shard_values = _laid_out(tmp_path, rank, 2)
        for name, param in shard.named_parameters():
            dim = getattr(param, "tp_dim", None)
            expected = full[name] if dim is None else full[name].chunk(2, dim)[rank]
            rows = min(param.shape[0], expected.shape[0])  # the vocabulary's padding row
            got = shard_values(name, 0, param.numel()).view(param.shape)[:rows]
            torch.testing.assert_close(got, expected[:rows], rtol=0, atol=0, msg=name)
            if rows == param.shape[0] and param.numel() > 7:  # a ZeRO range cutting rows
                torch.testing.assert_close(
                    shard_values(name, 3, param.numel() - 4),
                    expected.reshape(-1)[3 : param.numel() - 4],
                    rtol=0,
                    atol=0,
                    msg=name,
                )


@pytest.mark.parametrize(
    "change, message",
    [
        ({"activation_function": "relu"}, "activation_function 'relu'"),
        ({"n_inner": 100}, "n_inner 100"),
        ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx true"),
    ],
)
def test_what_meshwise_does_not_compute_is_named(tmp_path, change, message):
    save_gpt2(tmp_path)
    with pytest.raises(ValueError, match=message):
        gpt2_sizes({**read_config(tmp_path), **change}, "d")
