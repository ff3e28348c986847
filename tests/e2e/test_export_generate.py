"""``meshwise export`` and ``meshwise generate`` on a checkpoint a sharded run saved."""

import json

import pytest
import torch

from tests.e2e.conftest import SMALL, run_cli, run_main


@pytest.fixture(scope="module")
def saved(tmp_path_factory, corpus):
    """A checkpoint written by a tp 2 run (the export must undo the sharding)."""
    root = tmp_path_factory.mktemp("export")
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--steps",
        4,
        "--tp",
        2,
        "--save",
        root / "ckpt",
        cwd=root,
    )
    assert result.returncode == 0, result.stderr
    return root


def test_export_safetensors_is_the_unsharded_model(saved):
    from safetensors.torch import load_file

    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.serve.model import load_model

    result = run_cli("export", saved / "ckpt", "--out", saved / "plain", cwd=saved)
    assert result.returncode == 0, result.stderr
    tensors = load_file(saved / "plain" / "model.safetensors")
    config = json.loads((saved / "plain" / "config.json").read_text())
    assert config["d_model"] == 64 and config["n_layer"] == 2 and config["step"] == 4
    reference = dict(load_model(open_checkpoint(saved / "ckpt")).named_parameters())
    assert set(tensors) == set(reference)
    assert tensors["wte.weight"].shape == (256, 64)  # vocabulary whole, unpadded
    for name, value in tensors.items():
        assert torch.equal(value, reference[name].detach()), name


def test_export_hf_loads_in_transformers_with_the_same_logits(saved):
    transformers = pytest.importorskip("transformers")
    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.serve.model import load_model

    result = run_cli("export", saved / "ckpt", "--out", saved / "hf", "--format", "hf", cwd=saved)
    assert result.returncode == 0, result.stderr
    hf = transformers.AutoModelForCausalLM.from_pretrained(saved / "hf").eval()
    ours = load_model(open_checkpoint(saved / "ckpt"))
    tokens = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(tokens).logits, ours(tokens), rtol=1e-5, atol=1e-5)


def test_generate_continues_the_prompt(saved):
    args = [
        "generate",
        "--checkpoint",
        saved / "ckpt",
        "--prompt",
        "def main(",
        "--max-new-tokens",
        16,
        "--temperature",
        0,
    ]
    first, second = run_cli(*args, cwd=saved), run_cli(*args, cwd=saved)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("def main(") and first.stdout == second.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "--checkpoint", "nowhere", "--prompt", "x"], "nowhere: no such file"),
        (
            ["generate", "--checkpoint", "ckpt", "--prompt", "x", "--max-new-tokens", 0],
            "--max-new-tokens must be >= 1",
        ),
        (["export", "ckpt", "--out", "ckpt"], "already exists"),
    ],
)
def test_bad_input_exits_2(saved, args, message):
    result = run_main(*args, cwd=saved)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr and len(result.stderr.strip().splitlines()) == 1
