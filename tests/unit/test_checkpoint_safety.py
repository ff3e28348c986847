"""The pieces that keep a --save directory sound: manifest digest and shape, lineages,
pruning, room before a save, the directory lock."""

import json
import multiprocessing
import os
import random
from pathlib import Path

import pytest
import torch

from meshwise.checkpoint import resume
from meshwise.checkpoint.lineage import Lineage
from meshwise.checkpoint.lock import SaveDirBusy, SaveDirLock
from meshwise.checkpoint.manifest import DIGEST, MANIFEST
from meshwise.checkpoint.save_dir import SaveDir, with_headroom
from meshwise.checkpoint.store import (
    CheckpointError,
    complete_checkpoints,
    finalize,
    temp_dir,
    write_rank_file,
)
from meshwise.cli.ranks import Outcome, blame, describe
from meshwise.geometry.pieces import Piece

pytestmark = pytest.mark.timeout(60)


def _save(root: Path, step: int, run: str | None = None, ancestors=()) -> Path:
    tmp = temp_dir(root, step, run or "")
    tmp.mkdir(parents=True)
    entries = [
        (Piece.whole("w", (4, 3)), torch.arange(12.0)),
        (Piece.whole("b", (3,)), torch.ones(3)),
    ]
    meta = {"step": step, "optimizer_step": step}
    if run is not None:
        meta["lineage"] = Lineage(run, tuple(ancestors)).to_meta()
    return finalize(tmp, [write_rank_file(tmp, 0, entries)], meta, root / f"step-{step:08d}")


def test_every_single_bit_flip_of_the_manifest_is_caught_before_loading(tmp_path):
    path = _save(tmp_path, 5, "a")
    manifest = path / MANIFEST
    original = manifest.read_bytes()
    rng = random.Random(1)
    for _ in range(400):
        data = bytearray(original)
        bit = rng.randrange(len(data) * 8)
        data[bit // 8] ^= 1 << (bit % 8)
        manifest.write_bytes(bytes(data))
        with pytest.raises(CheckpointError, match="manifest") as err:
            resume.open_verified(path, {})
        assert "\n" not in str(err.value)
    manifest.write_bytes(original)
    resume.open_verified(path, {})
    (path / DIGEST).write_text("0" * 64 + "  manifest.json\n")
    with pytest.raises(CheckpointError, match="checksum mismatch with manifest.sha256"):
        resume.open_verified(path, {})
    (path / DIGEST).unlink()
    with pytest.raises(CheckpointError, match="manifest.sha256: missing"):
        resume.open_verified(path, {})


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda m: m["tensors"]["w"]["pieces"][0].pop("box_sizes"), "no 'box_sizes'"),
        (
            lambda m: m["tensors"]["w"]["pieces"][0].update(file="rank-00009.safetensors"),
            "unlisted file",
        ),
        (lambda m: m["tensors"]["w"]["pieces"][0].update(flat=[0, 99]), "flat [0, 99]"),
        (lambda m: m["tensors"]["w"].update(shape=[4, "3"]), "tensors.w.shape"),
        (lambda m: m["meta"].update(step="5"), "meta.step must be an integer"),
    ],
)
def test_an_old_manifest_without_digest_is_still_checked_for_its_shape(tmp_path, damage, message):
    path = _save(tmp_path, 5)
    manifest = json.loads((path / MANIFEST).read_text())
    manifest["version"] = 1  # written before manifests had a digest
    damage(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))
    (path / DIGEST).unlink()
    with pytest.raises(CheckpointError, match="damaged") as err:
        resume.open_verified(path, {})
    assert message in str(err.value)


def test_a_lineage_prunes_only_its_own_and_never_its_source(tmp_path):
    for step in (2, 4, 6):
        _save(tmp_path, step, "old")  # a run that went to step 6
    source = tmp_path / "step-00000002"
    lineage = Lineage.of(json.loads((source / MANIFEST).read_text())["meta"]).resumed_by("new", 2)
    assert lineage == Lineage("new", (("old", 2),))
    ours = SaveDir(tmp_path, "new", 1, lineage, frozenset({source}))
    _save(tmp_path, 3, "new", lineage.ancestors)
    assert ours.prune(1) == []  # the source is kept; old 4 and 6 are not this lineage's
    _save(tmp_path, 5, "new", lineage.ancestors)
    assert ours.prune(1) == [tmp_path / "step-00000003"]
    assert [p.name for p in complete_checkpoints(tmp_path)] == [
        "step-00000002",
        "step-00000004",
        "step-00000005",
        "step-00000006",
    ]


def test_a_continuing_run_prunes_its_ancestors_older_checkpoints(tmp_path):
    for step in (2, 4):
        _save(tmp_path, step, "first")
    lineage = Lineage("first").resumed_by("second", 4)
    _save(tmp_path, 6, "second", lineage.ancestors)
    pruned = SaveDir(tmp_path, "second", 2, lineage, frozenset()).prune(2)
    assert pruned == [tmp_path / "step-00000002"]
    assert Lineage("second").resumed_by("second", 6) == Lineage("second")  # a restart


def test_a_symlinked_checkpoint_is_pruned_as_a_link(tmp_path):
    target = _save(tmp_path / "elsewhere", 1, "r")
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / "step-00000001").symlink_to(target)
    _save(tmp_path / "save", 2, "r")
    SaveDir(tmp_path / "save", "r", 1, Lineage("r")).prune(1)
    assert not (tmp_path / "save" / "step-00000001").is_symlink()
    assert (target / MANIFEST).is_file()


def test_a_save_that_cannot_fit_prunes_first_or_names_the_space(tmp_path, monkeypatch):
    for step in (1, 2):
        _save(tmp_path, step, "r")

    def used() -> int:
        return sum(p.stat().st_size for p in tmp_path.rglob("*") if p.is_file())

    # A disk with room for the new checkpoint only once one old one is gone.
    capacity = used() + with_headroom(1 << 20) - 1
    monkeypatch.setattr(
        "meshwise.checkpoint.save_dir.shutil.disk_usage",
        lambda path: type("Usage", (), {"free": capacity - used()}),
    )
    plain = SaveDir(tmp_path, "r", None, Lineage("r"))
    problem = plain.prepare(3, 1 << 20)
    assert problem.startswith(
        f"cannot save step 3 in {tmp_path}: the checkpoint needs about 1.1 MiB, "
    ), problem
    assert "is free; free some space, pass --keep-last, or choose another --save" in problem
    assert not temp_dir(tmp_path, 3, "r").exists()
    pruning = SaveDir(tmp_path, "r", 2, Lineage("r"))
    assert pruning.prepare(3, 1 << 20) == ""
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step-00000002"]  # 2 - 1 kept
    assert temp_dir(tmp_path, 3, "r").is_dir()


def _take(save_dir: str, start, tried, results) -> None:
    start.wait(timeout=10)  # every contender tries at the same moment
    try:
        with SaveDirLock(save_dir, str(os.getpid())):
            tried.wait(timeout=10)  # held until every other contender has tried
            results.put("held")
    except SaveDirBusy as exc:
        tried.wait(timeout=10)
        results.put(str(exc))


def test_of_jobs_started_together_exactly_one_holds_the_directory(tmp_path):
    context = multiprocessing.get_context("fork")
    for trial in range(20):
        start, tried, results = context.Barrier(3), context.Barrier(3), context.Queue()
        procs = [
            context.Process(target=_take, args=(str(tmp_path / f"s{trial}"), start, tried, results))
            for _ in range(3)
        ]
        for p in procs:
            p.start()
        outcomes = [results.get(timeout=20) for _ in procs]
        for p in procs:
            p.join(timeout=10)
        assert outcomes.count("held") == 1, outcomes
        assert all("is in use by another meshwise job" in o for o in outcomes if o != "held")
        assert not (tmp_path / f"s{trial}" / ".meshwise-lock").exists()


def test_a_lock_left_by_a_crash_is_stale_not_held(tmp_path):
    (tmp_path / ".meshwise-lock").write_text('{"pid": 4242, "host": "h", "run": "r"}')
    with SaveDirLock(tmp_path, "mine") as lock:
        assert lock.held and lock.stale["pid"] == 4242
        with pytest.raises(SaveDirBusy, match="pid .* run mine"):
            SaveDirLock(tmp_path, "other").acquire()
    assert not (tmp_path / ".meshwise-lock").exists()


def test_the_rank_that_failed_first_is_blamed_not_its_peers():
    lost = "Traceback\nRuntimeError: [pair.cc:553] Connection closed by peer [127.0.0.1]:1"
    killed, peer = Outcome(1, -9, "", 2 << 30), Outcome(0, 1, lost)
    assert blame([peer, killed]) is killed  # even when the peer's exit was seen first
    assert describe(killed).startswith(
        "rank 1 was killed by signal SIGKILL (out of memory?): peak resident memory so far 2.00 GiB"
    )
    assert blame([peer]) is peer
    assert describe(peer) == (
        "rank 0: lost its connection to another rank (Connection closed "
        "by peer): that rank ended first, and its own output says why"
    )


def test_two_jobs_preparing_one_step_get_temporaries_of_their_own(tmp_path):
    """Two jobs saving the same step never write into one unfinished directory (a
    manifest hashed over a shared temporary once held the other job's tensors)."""
    first, second = SaveDir(tmp_path, "run-a"), SaveDir(tmp_path, "run-b")
    assert first.prepare(1, 1024) == "" and second.prepare(1, 1024) == ""
    assert first.temp_dir(1) != second.temp_dir(1)
    assert first.temp_dir(1).is_dir() and second.temp_dir(1).is_dir()
