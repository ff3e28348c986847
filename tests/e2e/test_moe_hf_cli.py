"""``train --init-from`` a Qwen3-MoE folder at --dp 2 --tp 2 --ep 2 and a Mixtral one at
--dp 4 --ep 2 --zero 3 (experts sharded over their expert-data-parallel pair), ``export
--format hf`` back: transformers loads the export (every expert gathered, published names)
and computes the trained model's logits."""

import pytest
import torch

from tests.e2e.conftest import run_cli, run_main
from tests.hf_llama import ATOL, HF_SIZES
from tests.hf_moe import save_hf_moe

pytest.importorskip("transformers")

RUN = ["--seq-len", "32", "--batch-size", "4", "--steps", "2", "--warmup-steps", "1", "-q"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "name, layout",
    [
        ("qwen3_moe", ["--dp", "2", "--tp", "2", "--ep", "2"]),
        ("mixtral", ["--dp", "4", "--ep", "2", "--zero", "3"]),
    ],
)
def test_moe_fine_tuned_at_ep2_exports_to_transformers(tmp_path, corpus, name, layout):
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.serve.model import load_model

    save_hf_moe(tmp_path / "hf", name)
    result = run_cli(
        "train", "--init-from", tmp_path / "hf", *layout, "--data", corpus, *RUN,
        "--save", tmp_path / "ckpt", cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    export = run_main(
        "export", tmp_path / "ckpt", "--out", tmp_path / "out", "--format", "hf", cwd=tmp_path
    )
    assert export.returncode == 0, export.stderr
    hf, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no tensor missing, unexpected or mismatched
    assert hf.config.model_type == name
    ours = load_model(open_checkpoint(tmp_path / "ckpt"))
    ids = torch.randint(
        0, HF_SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        diff = (hf.eval()(ids).logits - ours(ids)).abs().max().item()
    assert diff <= ATOL, diff
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    experts = "model.layers.1.mlp.experts.gate_up_proj"
    moved = start.state_dict()[experts] - hf.state_dict()[experts]
    assert moved[:2].abs().max() > 0 and moved[2:].abs().max() > 0  # both ep ranks' trained
