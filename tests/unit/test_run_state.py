"""Run state apart from the settings: computed once per launch, handed to every rank, and
read back from checkpoints written before it had an object of its own."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest
import torch

from meshwise.checkpoint.store import MANIFEST, finalize, temp_dir, write_rank_file
from meshwise.cli import launch
from meshwise.cli.main import build_parser
from meshwise.cli.train import _rank_main, run_train
from meshwise.geometry.pieces import Piece
from meshwise.train import run_state
from meshwise.train.config import TrainConfig
from meshwise.train.run_state import RECORDED_AT, RunState, record

RUN = RunState(
    run_id="20250102-130405-9f2c1a",
    resume="/ckpt/step-00000040",
    resume_step=40,
    resume_manifest="ab" * 32,
    schedule_start=40,
    tokenizer_digest="0123456789abcdef",
    chat_template_digest="fedcba9876543210",
    run_name="r",
    log_dir="out/logs",
    profile_dir="out/logs/profile",
)


def _checkpoint(root, step: int, meta: dict):
    tmp = temp_dir(root, step)
    tmp.mkdir(parents=True)
    entries = [(Piece.whole("w", (2,)), torch.ones(2))]
    return finalize(
        tmp, [write_rank_file(tmp, 0, entries)], {"step": step, **meta}, root / f"step-{step:08d}"
    )


def _old_config(**facts) -> dict:
    """A configuration as checkpoints recorded it while run state was part of the settings."""
    config = dataclasses.asdict(TrainConfig())
    for name, value in facts.items():
        section, key = RECORDED_AT[name]
        config[section][key] = value
    return config


def test_the_settings_hold_no_launcher_decision():
    fields = {key for section in dataclasses.asdict(TrainConfig()).values() for key in section}
    decided = {
        "schedule_start",
        "tokenizer_digest",
        "chat_template_digest",
        "run_id",
        "resume_step",
        "resume_manifest",
    }
    assert not fields & decided
    # --log-dir, --run-name and --profile-dir are flags: the settings keep what was given
    assert TrainConfig().runtime.log_dir is None


def test_a_record_keeps_every_fact_at_its_old_key_and_reads_back():
    cfg = TrainConfig()
    recorded = json.loads(json.dumps(record(cfg, RUN)))  # as a manifest holds it
    assert recorded["config"]["optim"]["schedule_start"] == 40
    assert recorded["config"]["data"]["tokenizer_digest"] == "0123456789abcdef"
    assert recorded["config"]["checkpoint"]["resume_step"] == 40
    assert recorded["config"]["runtime"]["log_dir"] == "out/logs"
    assert RunState.recorded(recorded) == RUN
    # the configuration's keys say the same where the run section is absent
    assert RunState.recorded({"config": recorded["config"]}) == dataclasses.replace(
        RUN, resume=None
    )


def test_a_checkpoint_from_before_the_run_state_resumes_its_schedule(tmp_path):
    optim = dataclasses.replace(TrainConfig().optim, steps=50, warmup_steps=5, lr_restart=True)
    old = _old_config(schedule_start=40, run_id="old", tokenizer_digest=None)
    old["optim"].update(steps=50, warmup_steps=5, lr_restart=True)
    del old["optim"]["min_lr_ratio"]  # a key from before it existed: the default
    path = _checkpoint(tmp_path, 45, {"config": old})
    run = RunState(run_id="new").starting_from(optim, path)
    digest = hashlib.sha256((path / MANIFEST).read_bytes()).hexdigest()
    assert (run.resume, run.resume_step, run.resume_manifest) == (str(path), 45, digest)
    assert run.schedule_start == 40 and run.run_id == "new"
    assert run.starting_from(optim, None) == RunState(run_id="new")
    with pytest.raises(ValueError, match="re-stretch"):
        RunState().starting_from(dataclasses.replace(optim, lr=0.5, lr_restart=False), path)


def test_a_trainer_without_run_state_computes_it_in_the_rank(tmp_path):
    data = tmp_path / "tokens.bin"
    (np.arange(4096) % 256).astype(np.uint16).tofile(data)
    cfg = TrainConfig()
    cfg.runtime.log_dir = "mine"
    run = RunState.in_rank(cfg, data).starting_from(cfg.optim, None)
    assert run == RunState(log_dir="mine")  # no run id, digests of byte-level data: none


def test_meshwise_train_computes_the_run_state_once_per_launch(tmp_path, monkeypatch):
    corpus, save, metrics = tmp_path / "c.txt", tmp_path / "save", tmp_path / "m.jsonl"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    save.mkdir()
    cfg = TrainConfig()
    old = _old_config(schedule_start=0)
    start = _checkpoint(tmp_path / "before", 2, {"config": old, "model": cfg.model.sizes(256)})
    computed, launched = [], []
    original = run_state.schedule_start

    def counted(optim, ckpt):
        computed.append(ckpt.step)
        return original(optim, ckpt)

    def fake_launch(fn, args, *rest, **kwargs):
        launched.append((fn, args))
        if len(launched) == 1:
            raise launch.RankFailed("rank 1 failed")

    monkeypatch.setattr(run_state, "schedule_start", counted)
    monkeypatch.setattr(launch, "launch", fake_launch)
    args = build_parser().parse_args(
        [
            "train",
            "--data",
            str(corpus),
            "--cache-dir",
            str(tmp_path / "cache"),
            "--save",
            str(save),
            "--resume",
            str(start),
            "--max-restarts",
            "1",
            "--metrics",
            str(metrics),
            "--dp",
            "1",
            "--steps",
            "200",  # the checkpoint's schedule, which the resumed one continues
            "--quiet",
        ]
    )
    assert run_train(args) == 0
    assert computed == [2, 2]  # once before each launch (the restart found no newer one)
    (fn, first), (_, second) = launched
    assert fn is _rank_main and first == second
    given, run = first[0], first[1]
    assert isinstance(run, RunState) and run.run_id and run.resume == str(start)
    assert (run.resume_step, run.run_name, run.log_dir) == (2, "save", str(save / "logs"))
    assert given.runtime.log_dir is None  # the settings as given; the decision is the run's
    side = json.loads((tmp_path / "m.jsonl.config.json").read_text())
    assert RunState.recorded(side) == run
