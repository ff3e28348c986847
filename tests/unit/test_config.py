import os
from pathlib import Path

import pytest

from meshwise.cli.main import build_parser
from meshwise.cli.train import train_config
from meshwise.train.config import TrainConfig
from meshwise.train.layout_rules import COMPOSITIONS, composition_table

DOCS = Path(__file__).resolve().parents[2] / "docs"


def parse(*argv):
    return train_config(build_parser().parse_args(["train", *argv]))[0]


def test_the_layouts_page_shows_the_table_the_check_uses():
    assert composition_table() in (DOCS / "layouts.md").read_text()


@pytest.mark.parametrize("axes, example, stages", COMPOSITIONS)
def test_every_listed_composition_validates(axes, example, stages):
    for zero in stages:
        parse(*example.split(), "--zero", str(zero), "--batch-size", "16")
    if 3 in stages:
        parse(*example.split(), "--zero", "3", "--reshard-after-forward", "--batch-size", "16")


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_reshard_after_forward_is_for_zero_3_only(zero):
    with pytest.raises(
        ValueError,
        match=f"--reshard-after-forward needs --zero 3 \\(got --zero {zero}\\).*valid: --zero 3",
    ):
        parse("--dp", "2", "--pp", "2", "--zero", str(zero), "--reshard-after-forward")


def test_no_flags_is_the_two_rank_demo():
    cfg = parse()
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (2, 1, 1)
    assert cfg.model.preset == "tiny"


def test_toml_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("dp = 1\nbatch-size = 32\n[optim]\nlr = 0.01\nsteps = 7\n")
    cfg = parse("--config", str(path), "--steps", "9")
    assert (cfg.parallel.dp, cfg.data.batch_size, cfg.optim.lr, cfg.optim.steps) == (1, 32, 0.01, 9)


def test_toml_unknown_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("batch_sise = 3\n")
    with pytest.raises(ValueError, match="unknown key 'batch_sise'"):
        parse("--config", str(path))


def test_pipeline_micro_batches_default_to_pp():
    cfg = parse("--pp", "4", "--dp", "1")
    assert cfg.parallel.num_micro_batches == 4
    assert TrainConfig().parallel.num_micro_batches == 1


def test_the_demo_default_is_for_the_cpu_only(monkeypatch):
    monkeypatch.setattr("meshwise.device.choice.resolve_device", lambda device: "cuda")
    assert parse().parallel.dp == 1
    monkeypatch.setattr("meshwise.device.choice.resolve_device", lambda device: "cpu")
    assert parse().parallel.dp == 2


def test_gpus_are_counted_before_spawning(monkeypatch):
    import torch

    from meshwise.cli.preflight import prepare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(ValueError, match="2 local ranks need 2 GPUs, but 1 are visible"):
        prepare(parse("--device", "cuda", "--dp", "2"))


def test_bf16_on_a_gpu_without_it_is_refused_before_spawning(monkeypatch):
    import torch

    from meshwise.cli.preflight import prepare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    v100 = {"name": "Tesla V100", "capability": [7, 0]}
    monkeypatch.setattr(
        "meshwise.device.choice.gpu_facts", lambda: {"gpus": [v100, v100], "nccl": (2, 21, 5)}
    )
    with pytest.raises(ValueError, match="--dtype bf16: Tesla V100 has no bfloat16 support"):
        prepare(parse("--device", "cuda", "--dp", "2", "--dtype", "bf16"))


def test_bf16_on_an_nccl_without_it_is_refused_before_spawning(monkeypatch):
    import torch

    from meshwise.cli.preflight import prepare

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    a100 = {"name": "NVIDIA A100", "capability": [8, 0]}
    monkeypatch.setattr(
        "meshwise.device.choice.gpu_facts", lambda: {"gpus": [a100], "nccl": (2, 7, 8)}
    )
    with pytest.raises(
        ValueError, match="--compress bf16: this PyTorch's NCCL 2.7.8 carries no bfloat16"
    ):
        prepare(parse("--device", "cuda", "--dp", "1", "--compress", "bf16"))


def test_torchrun_world_gives_dp(monkeypatch):
    for name, value in dict(
        RANK="0", WORLD_SIZE="8", LOCAL_RANK="0", MASTER_ADDR="h", MASTER_PORT="1"
    ).items():
        monkeypatch.setenv(name, value)
    cfg, origins = train_config(build_parser().parse_args(["train", "--tp", "2", "--pp", "2"]))
    assert cfg.parallel.dp == 2 and origins["dp"] == "torchrun"


def test_a_one_rank_launch_leaves_no_torchrun_environment(monkeypatch):
    from meshwise.cli import launch

    for name in launch.TORCHRUN_VARS:
        monkeypatch.delenv(name, raising=False)
    launch.launch(_nothing, (), 1, "cpu", 30)
    assert not launch.under_torchrun()
    assert not any(name in os.environ for name in launch.TORCHRUN_VARS)


def _nothing():
    return None


def test_options_without_effect_are_named():
    from meshwise.cli.unused_settings import noop_warnings

    cfg, origins = train_config(
        build_parser().parse_args(
            [
                "train",
                "--schedule",
                "gpipe",
                "--zero",
                "3",
                "--grad-reduce-dtype",
                "bf16",
                "--max-skipped-steps",
                "2",
                "--sample-tokens",
                "500",
                "--eval-batches",
                "2",
            ]
        )
    )
    found = "\n".join(noop_warnings(cfg, origins))
    for flag in (
        "--schedule gpipe",
        "--grad-reduce-dtype",
        "--max-skipped-steps",
        "--sample-tokens 500",
        "--eval-batches",
    ):
        assert flag in found
    quiet, origins = train_config(build_parser().parse_args(["train"]))
    assert noop_warnings(quiet, origins) == []


def test_help_shows_the_dataclass_defaults_and_the_docs_document_every_flag():
    from meshwise.cli.train_flags import TRAIN_FLAGS

    text = build_parser()._subparsers._group_actions[0].choices["train"].format_help()
    assert "(default: 200)" in text and "(default: 0.001)" in text  # steps, lr
    table = (DOCS / "flags.md").read_text()
    missing = [
        flag for flag, *_ in TRAIN_FLAGS if f"`{flag}" not in table and f" {flag}" not in table
    ]
    assert not missing, f"docs/flags.md lacks {missing}"


def test_version_flag(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--version"])
    assert capsys.readouterr().out.startswith("meshwise ")


def test_slow_bf16_on_this_cpu_is_said_once(monkeypatch, caplog, tmp_path):
    from meshwise.cli import preflight

    corpus = tmp_path / "c.txt"
    corpus.write_text("x" * 5000)
    monkeypatch.setattr(preflight, "bf16_slowdown", lambda: 12.0)
    cfg = parse("--dtype", "bf16", "--data", str(corpus), "--cache-dir", str(tmp_path / "cache"))
    with caplog.at_level("WARNING", logger="meshwise"):
        preflight.prepare(cfg)
    assert [r.getMessage() for r in caplog.records if "bf16" in r.getMessage()] == [
        "warning: --dtype bf16: a bf16 matmul measured 12x slower than fp32 on this CPU (no "
        "native bf16 support); fp32 will train faster"
    ]


def test_flag_names_follow_the_fields_they_set():
    """``flag_name`` (error messages, --init-from) names the flag of every field but
    those whose flag reads better than the field (the balancing settings keep
    ``LlamaConfig``'s names)."""
    from meshwise.cli.train_flags import TRAIN_FLAGS
    from meshwise.train.config import flag_name

    renamed = {flag: field for flag, _, field, _, _ in TRAIN_FLAGS if flag_name(field) != flag}
    assert renamed == {
        "--model": "preset",
        "--data": "path",
        "--moe-aux-loss-coef": "aux_loss_coef",
        "--moe-bias-update-rate": "bias_update_rate",
    }


@pytest.mark.parametrize(
    "argv, message",
    [
        (
            ["--cp", "2", "--seq-len", "30"],
            "--seq-len 30 does not split into 2 x cp = 4 load-balanced chunks; valid: a multiple "
            "of 4, e.g. --seq-len 28 or 32",
        ),
        (
            ["--cp", "2", "--tp", "4", "--sp", "--seq-len", "36"],
            "--seq-len 36 does not split into 2 x cp = 4 load-balanced chunks whose tokens split "
            "across tp = 4; valid: a multiple of 8, e.g. --seq-len 32 or 40",
        ),
        (
            ["--tp", "2", "--sp", "--seq-len", "31"],
            "--seq-len 31 does not split into slices across tp = 2; valid: a multiple of 2",
        ),
        (
            ["--sp"],
            "--sp splits the sequence across the tp ranks between their layers and needs "
            "--tp > 1; valid: --sp with --tp 2 or more, or no --sp",
        ),
        (["--cp", "0"], "--cp must be a finite number > 0"),
    ],
)
def test_sequence_splits_that_cannot_work_name_the_valid_values(argv, message):
    with pytest.raises(ValueError) as info:
        parse("--dp", "1", *argv)
    assert message in str(info.value)


def test_odd_cp_is_load_balanced_too():
    cfg = parse("--cp", "3", "--seq-len", "126", "--dp", "1")
    assert cfg.parallel.dims.world_size == 3 and cfg.parallel.sequence_divisor == 6


def test_cp_needs_a_model_whose_attention_runs_as_a_ring(monkeypatch):
    import dataclasses

    from meshwise.models import families

    gpt = families.FAMILIES["gpt"]
    no_ring = dataclasses.replace(gpt, plan=lambda cfg: dataclasses.replace(gpt.plan(cfg), cp=()))
    monkeypatch.setitem(families.FAMILIES, "gpt", no_ring)
    with pytest.raises(
        ValueError,
        match="--cp 2: the attention of --model tiny cannot run as a ring; valid: --cp 1",
    ):
        parse("--cp", "2")
    parse("--cp", "1", "--dp", "1")


def test_sp_is_a_switch_on_the_command_line_and_a_bool_in_toml(tmp_path):
    assert parse("--tp", "2", "--sp").parallel.sp is True
    assert parse("--tp", "2").parallel.sp is False
    path = tmp_path / "run.toml"
    path.write_text("tp = 2\n[parallel]\nsp = true\ncp = 2\n")
    cfg = parse("--config", str(path))
    assert (cfg.parallel.sp, cfg.parallel.cp, cfg.parallel.dims.world_size) == (True, 2, 4)
    path.write_text("tp = 2\nsp = 1\n")
    with pytest.raises(ValueError, match="sp = 1 is not true or false"):
        parse("--config", str(path))


def test_a_context_too_short_names_the_init_from_directory_not_a_preset():
    cfg = TrainConfig()
    cfg.model.preset, cfg.model.init_from, cfg.model.block_size = "llama-tiny", "q2", 512
    cfg.data.seq_len = 1024
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert str(err.value) == (
        "--seq-len 1024 exceeds the model's context of 512 tokens (from --init-from "
        "q2's config.json); use --seq-len <= 512"
    )


def test_layers_a_pipeline_cannot_split_list_the_valid_pp():
    cfg = TrainConfig()
    cfg.parallel.pp, cfg.model.n_layer = 3, 4
    with pytest.raises(ValueError) as err:
        cfg.validate()
    assert str(err.value).endswith(
        "equal chunks; valid: --pp 1, 2, 4, or --n-layer a multiple of 3"
    )


def test_a_misspelled_flag_gets_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(["train", "--batchsize", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err == (
        "meshwise train: error: unrecognized arguments: --batchsize 4; did you mean --batch-size?"
    )


def test_resume_auto_on_an_empty_save_directory_says_it_starts_fresh(caplog, tmp_path):
    from meshwise.cli import preflight

    corpus, save = tmp_path / "c.txt", tmp_path / "ckpts"
    corpus.write_text("x" * 5000)
    flags = ["--data", str(corpus), "--cache-dir", str(tmp_path / "cache"), "--save", str(save)]
    with caplog.at_level("INFO", logger="meshwise"):
        preflight.prepare(parse(*flags, "--resume", "auto"))
    assert f"--resume auto: {save} holds no complete checkpoint yet; starting at step 1" in [
        r.getMessage() for r in caplog.records
    ]


@pytest.mark.parametrize("count", ["0", "-2"])
def test_micro_batches_below_one_are_refused_not_replaced_by_the_default(count):
    with pytest.raises(ValueError, match=f"--micro-batches {count} .*valid: 1 or more"):
        parse("--dp", "1", "--pp", "2", "--schedule", "zb-h1", "--micro-batches", count)
