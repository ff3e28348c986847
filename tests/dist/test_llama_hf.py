"""A Hugging Face Llama imported into parallel layouts computes transformers' logits.

Each test saves a small random ``LlamaForCausalLM`` (no downloads), lays
meshwise's Llama out on 2 gloo ranks, lets an engine fill what each rank keeps
from the safetensors slices of its tensor-parallel box or ZeRO range, runs a
forward and compares the logits with transformers' in float32.
"""

import pytest
import torch

from meshwise.geometry.sequence import zigzag_slice
from meshwise.mesh import Mesh, ParallelDims
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from meshwise.sharding.adamw import AdamWConfig
from meshwise.sharding.buckets import ZeroOptimizer
from meshwise.sharding.zero3 import ZeroStage3
from tests.hf_llama import ATOL, LLAMA3_SCALING, hf_logits, laid_out, save_hf_llama, token_ids

pytest.importorskip("transformers")


def _engine(pm, mesh, values, zero: int = 0):
    if zero == 3:
        (chunk,) = pm.chunks
        return ZeroStage3(chunk, mesh.dp_group, AdamWConfig(), units=pm.layers(), values=values)
    return ZeroOptimizer(pm.named_parameters(), mesh.dp_group, zero, AdamWConfig(),
                         modules=pm.chunks, values=values)


def _tp2_diff(directory) -> float:
    mesh = Mesh.build(ParallelDims(tp=2))
    pm, values = laid_out(directory, tp_group=mesh.tp_group)
    _engine(pm, mesh, values)
    ids = token_ids()
    with torch.no_grad():
        logits = pm.full_logits(pm.chunks[0](ids))  # gathered over the vocabulary shards
    return (logits - hf_logits(directory, ids)).abs().max().item()


def _pp2_diff(directory, virtual_stages: int) -> float | None:
    mesh = Mesh.build(ParallelDims(pp=2))
    pm, values = laid_out(directory, pp_rank=mesh.pp_rank, pp_size=2,
                          virtual_stages=virtual_stages, tie_group=mesh.tie_group)
    kind = "interleaved-1f1b" if virtual_stages > 1 else "1f1b"
    runtime = PipelineRuntime(pm.chunks, build_schedule(kind, 2, 2, virtual_stages), mesh.pp_group,
                              _engine(pm, mesh, values), loss_fn=pm.loss)
    ids = token_ids()
    with torch.no_grad():
        logits = runtime.forward_only(ids)  # on the last stage's rank only
    if logits is None:
        return None
    return (logits - hf_logits(directory, ids)).abs().max().item()


def _zero3_diff(directory) -> float:
    mesh = Mesh.build(ParallelDims(dp=2))
    pm, values = laid_out(directory)
    _engine(pm, mesh, values, zero=3)  # each rank reads only its flat range of each unit
    ids = token_ids()
    with torch.no_grad():
        logits = pm.chunks[0](ids)
    return (logits - hf_logits(directory, ids)).abs().max().item()


def _cp2_logits(directory, tp: int) -> torch.Tensor:
    """This cp rank's logits (its zigzag chunks) of a forward at cp 2 (x tp with --sp)."""
    mesh = Mesh.build(ParallelDims(cp=2, tp=tp))
    pm, values = laid_out(directory, tp_group=mesh.tp_group if tp > 1 else None, cp_group=mesh.cp_group,
                          sequence_parallel=tp > 1)
    ZeroOptimizer(pm.named_parameters(), mesh.dp_cp_group, 0, AdamWConfig(), modules=pm.chunks,
                  values=values)
    ids = zigzag_slice(token_ids(), 1, mesh.cp_rank, 2)  # (2, 12): chunks r and 3 - r
    with torch.no_grad():
        return pm.full_logits(pm.chunks[0](ids))


@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-llama")
    save_hf_llama(root / "sharded", max_shard_size="60KB")
    save_hf_llama(root / "tied-llama3", tie=True, rope_scaling=LLAMA3_SCALING, seed=1)
    return root


@pytest.mark.parametrize("variant", ["sharded", "tied-llama3"])
def test_tp2_logits_match_transformers(dist_pools, hf_dirs, variant):
    diffs = dist_pools.run(2, _tp2_diff, hf_dirs / variant)
    assert max(diffs) <= ATOL, diffs


@pytest.mark.parametrize("variant, virtual_stages", [("sharded", 1), ("tied-llama3", 2)])
def test_pp2_logits_match_transformers(dist_pools, hf_dirs, variant, virtual_stages):
    first, last = dist_pools.run(2, _pp2_diff, hf_dirs / variant, virtual_stages)
    assert first is None and last <= ATOL, last


def test_zero3_shards_read_from_the_files_match_transformers(dist_pools, hf_dirs):
    diffs = dist_pools.run(2, _zero3_diff, hf_dirs / "sharded")
    assert max(diffs) <= ATOL, diffs


@pytest.mark.parametrize("variant, tp", [("sharded", 1), ("tied-llama3", 2)])
def test_cp2_logits_match_transformers(dist_pools, hf_dirs, variant, tp):
    """Context parallel: each cp rank's chunks of the logits are transformers' (rotary
    positions of the chunks it holds, attention over the whole sequence by the ring)."""
    per_rank = dist_pools.run(2 * tp, _cp2_logits, hf_dirs / variant, tp)
    expected = hf_logits(hf_dirs / variant, token_ids())
    for rank, logits in enumerate(per_rank):
        cp_rank = rank // tp
        want = zigzag_slice(expected, 1, cp_rank, 2)
        assert (logits - want).abs().max().item() <= ATOL, (rank, variant)


# Mistral, Qwen2 and Qwen3 (tests/unit/test_hf_families.py: tp 1) on every axis.
OTHER_FAMILIES = {"qwen2-tied": dict(model_type="qwen2", tie=True),
                  "qwen3-head32": dict(model_type="qwen3", head_dim=32),
                  "mistral-window8": dict(model_type="mistral", sliding_window=8)}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-families")
    for name, kwargs in OTHER_FAMILIES.items():
        save_hf_llama(root / name, **kwargs)
    return root


@pytest.mark.parametrize("name", list(OTHER_FAMILIES))
def test_other_families_match_transformers_at_tp2_pp2_and_zero3(dist_pools, family_dirs, name):
    directory = family_dirs / name
    assert max(dist_pools.run(2, _tp2_diff, directory)) <= ATOL
    first, last = dist_pools.run(2, _pp2_diff, directory, 1)
    assert first is None and last <= ATOL, last
    assert max(dist_pools.run(2, _zero3_diff, directory)) <= ATOL
