"""``train --init-from`` a Hugging Face Llama directory, ``export --format hf`` back,
and every bad input to them refused before any rank starts (exit 2, one line)."""

import json
import shutil

import pytest
import torch

from tests.e2e.conftest import run_cli, run_main
from tests.hf_llama import ATOL, HF_SIZES, save_gpt2, save_hf_llama

pytest.importorskip("transformers")

RUN = ["--seq-len", "32", "--batch-size", "4", "--steps", "3", "--warmup-steps", "1", "-q"]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, corpus):
    """A sharded random Llama with a BPE tokenizer.json (300 ids, within its 301)."""
    from meshwise.data.bpe import save_tokenizer, train_bpe

    root = tmp_path_factory.mktemp("hf-llama-cli")
    save_hf_llama(root / "hf", max_shard_size="60KB")
    text = corpus.read_text()
    save_tokenizer(
        train_bpe([text[i : i + 4096] for i in range(0, len(text), 4096)], 300),
        root / "hf" / "tokenizer.json",
    )
    return root / "hf"


@pytest.mark.timeout(300)
def test_init_from_train_save_export_round_trip(tmp_path, hf_dir, corpus):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.data.tokenizer import load_tokenizer
    from meshwise.serve.model import load_model

    result = run_cli(
        "train",
        "--init-from",
        hf_dir,
        "--tp",
        2,
        "--data",
        corpus,
        *RUN,
        "--save",
        tmp_path / "ckpt",
        "--metrics",
        tmp_path / "m.jsonl",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    config = json.loads((tmp_path / "m.jsonl.config.json").read_text())
    assert config["config"]["data"]["tokenizer"] == str((hf_dir / "tokenizer.json").resolve())
    assert config["origins"]["n_kv_head"] == "init-from"
    export = run_main(
        "export", tmp_path / "ckpt", "--out", tmp_path / "out", "--format", "hf", cwd=tmp_path
    )
    assert export.returncode == 0, export.stderr
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ours = load_model(open_checkpoint(tmp_path / "ckpt"))
    assert ours.cfg.vocab_size == HF_SIZES["vocab_size"] and ours.cfg.n_kv_head == 2
    ids = torch.randint(
        0, HF_SIZES["vocab_size"], (2, 40), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= ATOL, diff
    start = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert not torch.equal(start.model.norm.weight, hf.model.norm.weight)  # it trained
    text = "def main(argv):\n    return 0\n"
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tokenizer.encode(text, add_special_tokens=False) == load_tokenizer(
        hf_dir / "tokenizer.json"
    ).encode(text)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "model_type, sizes, layout",
    [
        ("qwen2", dict(tie=True), ["--pp", "2"]),  # the tied head on the last stage
        ("qwen3", dict(head_dim=32), ["--tp", "2"]),
        ("mistral", dict(sliding_window=8), ["--dp", "2", "--zero", "3"]),
        ("gpt2", {}, ["--tp", "2", "--pp", "2"]),  # into meshwise's GPT
    ],
)
def test_other_families_fine_tune_and_export_through_transformers(
    tmp_path, corpus, model_type, sizes, layout
):
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.serve.model import load_model

    if model_type == "gpt2":
        save_gpt2(tmp_path / "hf")
    else:
        save_hf_llama(tmp_path / "hf", model_type=model_type, **sizes)
    result = run_cli(
        "train",
        "--init-from",
        tmp_path / "hf",
        *layout,
        "--data",
        corpus,
        *RUN,
        "--save",
        tmp_path / "ckpt",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    export = run_main(
        "export", tmp_path / "ckpt", "--out", tmp_path / "out", "--format", "hf", cwd=tmp_path
    )
    assert export.returncode == 0, export.stderr
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert hf.config.model_type == model_type
    ours = load_model(open_checkpoint(tmp_path / "ckpt"))
    ids = torch.randint(
        0, HF_SIZES["vocab_size"], (2, 24), generator=torch.Generator().manual_seed(0)
    )
    with torch.no_grad():
        diff = (hf(ids).logits - ours(ids)).abs().max().item()
    assert diff <= ATOL, diff
    start = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert not torch.equal(start.lm_head.weight, hf.lm_head.weight)  # it trained


def _copy(hf_dir, tmp_path):
    return shutil.copytree(hf_dir, tmp_path / "copy")


def _edit_config(directory, **change):
    path = directory / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))


def _drop_tensor(directory, name):
    index = directory / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    del data["weight_map"][name]
    index.write_text(json.dumps(data))


def _bad_other_architecture(d, _):
    _edit_config(d, model_type="bert", architectures=["BertForMaskedLM"])


def _bad_shapes(d, _):
    _edit_config(d, intermediate_size=128)


def _bad_missing_shard(d, _):
    next(d.glob("model-00002-*.safetensors")).unlink()


def _bad_missing_tensor(d, _):
    _drop_tensor(d, "model.layers.3.mlp.up_proj.weight")


def _bad_big_tokenizer(d, corpus):
    from meshwise.data.bpe import save_tokenizer, train_bpe

    save_tokenizer(train_bpe([corpus.read_text()], 512), d / "tokenizer.json")


def _bad_rope(d, _):
    _edit_config(d, rope_scaling={"rope_type": "yarn", "factor": 4.0})


def _bad_moe(d, _):
    _edit_config(d, num_local_experts=8)


@pytest.mark.parametrize(
    "spoil, flags, message",
    [
        (_bad_other_architecture, [], "config.json describes model_type 'bert'"),
        (
            _bad_shapes,
            [],
            "model.layers.0.mlp.gate_proj.weight is stored as [96, 64] but "
            "config.json implies [128, 64]",
        ),
        (_bad_missing_shard, [], "the shard model-00002-"),
        (_bad_missing_tensor, [], "lists no tensor model.layers.3.mlp.up_proj.weight"),
        (_bad_big_tokenizer, [], "config.json; valid: --tokenizer PATH of at most 301 tokens"),
        (_bad_rope, [], "rope_scaling type 'yarn' is not supported; valid: llama3"),
        (_bad_moe, [], "config.json has MoE blocks (num_local_experts 8)"),
        (None, ["--n-layer", "2"], "--n-layer 2 contradicts --init-from"),
        (None, ["--vocab-size", "512"], "--vocab-size 512 contradicts --init-from"),
        (None, ["--model", "tiny"], "--model tiny is a gpt model but --init-from"),
        (
            None,
            ["--tp", "4"],
            "--tp 4 cannot split the model's 2 key/value heads, 4 query heads "
            "and MLP width 96: each tp rank must hold whole key/value heads; "
            "valid: --tp 1, 2",
        ),
    ],
)
def test_bad_init_from_exits_2_with_one_line(tmp_path, hf_dir, corpus, spoil, flags, message):
    directory = _copy(hf_dir, tmp_path)
    if spoil is not None:
        spoil(directory, corpus)
    result = run_main(
        "train", "--init-from", directory, "--data", corpus, *RUN, *flags, cwd=tmp_path
    )
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--init-from", "no-such-dir"], "--init-from no-such-dir: no such directory"),
        (["--n-kv-head", "2"], "--n-kv-head applies to the llama models, not --model tiny"),
        (["--model", "llama-tiny", "--n-kv-head", "3"], "--n-kv-head 3 does not divide --n-head 4"),
        (["--model", "llama-tiny", "--dropout", "0.1"], "the llama family trains without dropout"),
        (
            ["--model", "llama-tiny", "--n-kv-head", "4", "--tp", "4"]
            + ["--lora-rank", "4", "--quantize-base", "nf4"],
            "o_proj holds 128 / tp 4 = 32 values per rank, not whole 64-value NF4 blocks; "
            "valid: --tp 1, 2",
        ),
    ],
)
def test_bad_llama_settings_exit_2_with_one_line(tmp_path, corpus, flags, message):
    result = run_main("train", "--data", corpus, *RUN, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(
    "key, value, wanted",
    [
        ("tie_word_embeddings", "false", "is not true or false"),  # truthy: would drop lm_head
        ("hidden_size", 64.0, "is not an integer"),
        ("num_hidden_layers", None, "is not an integer"),
        ("intermediate_size", [96], "is not an integer"),
        ("rms_norm_eps", "1e-5", "is not a number"),
    ],
)
def test_config_json_values_of_the_wrong_type_exit_2_naming_file_and_key(
    tmp_path, hf_dir, corpus, key, value, wanted
):
    directory = _copy(hf_dir, tmp_path)
    _edit_config(directory, **{key: value})
    result = run_main("train", "--init-from", directory, "--data", corpus, *RUN, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{directory}/config.json: {key} = {json.dumps(value)} {wanted}" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.timeout(300)
def test_qwen3_norm_gradients_are_summed_once_with_and_without_sequence_parallel(tmp_path, corpus):
    """Each tp rank normalises its own heads: the q/k norm's gradient is summed over tp
    by the norm itself, or by the sequence-parallel sync under --sp, never both."""
    save_hf_llama(tmp_path / "hf", model_type="qwen3", head_dim=32)
    curves = {}
    for name, layout in (("tp1", []), ("tp2", ["--tp", "2"]), ("tp2-sp", ["--tp", "2", "--sp"])):
        metrics = tmp_path / f"{name}.jsonl"
        result = run_cli(
            "train",
            "--init-from",
            tmp_path / "hf",
            *layout,
            "--data",
            corpus,
            *RUN,
            "--metrics",
            metrics,
            cwd=tmp_path,
        )
        assert result.returncode == 0, result.stderr
        curves[name] = [json.loads(line) for line in metrics.read_text().splitlines()]
    for name in ("tp2", "tp2-sp"):
        for ref, got in zip(curves["tp1"], curves[name], strict=True):
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), name
            assert got["grad_norm"] == pytest.approx(ref["grad_norm"], rel=1e-5), name
