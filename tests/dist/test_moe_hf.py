"""Mixtral, Qwen3-MoE and Qwen2-MoE folders imported at --ep 2 (and --tp 2 --ep 2) compute
transformers' logits; each rank reads only its own experts' tensors from the files."""

import pytest
import torch

from meshwise.hf.safetensors_dir import SafetensorsDir
from meshwise.mesh import Mesh, ParallelDims
from tests.hf_llama import ATOL, hf_logits, laid_out, materialize, token_ids
from tests.hf_moe import MOE_FAMILIES, save_hf_moe

pytest.importorskip("transformers")


def _experts_read(read_calls: list[str]) -> set[int]:
    """The experts whose stored tensors were read (``...experts.{j}.{w}.weight``)."""
    return {
        int(name.split(".experts.")[1].split(".")[0]) for name in read_calls if ".experts." in name
    }


def _ep_diff(directory, tp: int) -> tuple[float, set[int]]:
    """This rank's logits against transformers' for its own tokens (each dp rank routes
    different tokens through the same experts), and the experts it read."""
    mesh = Mesh.build(ParallelDims(dp=2, tp=tp, ep=2))
    opened: list[str] = []
    read = SafetensorsDir.read

    def recording(self, name, piece):
        opened.append(name)
        return read(self, name, piece)

    SafetensorsDir.read = recording  # this worker process's reads only
    try:
        pm, values = laid_out(
            directory, tp_group=mesh.tp_group if tp > 1 else None, ep_group=mesh.ep_group
        )
        materialize(pm, values)
    finally:
        SafetensorsDir.read = read
    ids = token_ids(seed=mesh.dp_rank)
    with torch.no_grad():
        logits = pm.full_logits(pm.chunks[0](ids)) if tp > 1 else pm.chunks[0](ids)
    return (logits - hf_logits(directory, ids)).abs().max().item(), _experts_read(opened)


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf-moe-ep")
    for name in MOE_FAMILIES:
        save_hf_moe(root / name, name)
    return root


@pytest.mark.parametrize("name", list(MOE_FAMILIES))
def test_ep2_logits_match_transformers_reading_only_own_experts(dist_pools, moe_dirs, name):
    (diff0, read0), (diff1, read1) = dist_pools.run(2, _ep_diff, moe_dirs / name, 1)
    assert max(diff0, diff1) <= ATOL, (diff0, diff1)
    assert (read0, read1) == ({0, 1}, {2, 3})  # 4 experts over ep 2, in rank order


def test_tp2_ep2_logits_match_transformers(dist_pools, moe_dirs):
    """Qwen2-MoE: attention and the shared expert split over tp, experts over ep."""
    results = dist_pools.run(4, _ep_diff, moe_dirs / "qwen2_moe", 2)
    assert max(diff for diff, _ in results) <= ATOL, results
