"""Two ``torchrun`` launchers, as on two machines, running docs/multi-node.md's commands.

With root and ``ip netns``, each launcher lives in its own network namespace
(its own interfaces and loopback), the two joined by a veth pair: the ranks
must find each other across that link, as across two hosts, which needs
``GLOO_SOCKET_IFNAME``. Otherwise both launchers share this machine's loopback.
Either way the two-node job must give the per-step losses of ``--dp 2`` on one
machine. With a shaped link (a rate limit by ``tc``) and two ranks per node,
``--allreduce hierarchical`` must beat a flat ring in ``meshwise bench comm``
and train with the losses of ``--dp 4`` on one machine.
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.two_nodes import TwoNodes, unavailable
from meshwise.cli.launch import free_port
from tests.e2e.conftest import SMALL, metrics_written, read_metrics, run_cli
from tests.e2e.conftest import process_alive as _alive

STEPS = 6


def _torchrun() -> str:
    beside = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    path = beside or shutil.which("torchrun")
    if path is None:
        pytest.skip("torchrun is not installed beside this Python")
    return path


def _node_command(node_rank: int, master: str, port: int, corpus, metrics) -> list[str]:
    return [
        _torchrun(),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        str(node_rank),
        "--master-addr",
        master,
        "--master-port",
        str(port),
        "-m",
        "meshwise",
        "train",
        *map(str, SMALL),
        "--data",
        str(corpus),
        "--dp",
        "2",
        "--steps",
        str(STEPS),
        "--timeout-s",
        "60",
        "--metrics",
        str(metrics),
    ]


def _run_nodes(commands, envs, cwd) -> None:
    procs = [
        subprocess.Popen(
            cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for cmd, env in zip(commands, envs)
    ]
    try:
        outs = [p.communicate(timeout=180) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err


def _reference(tmp_path, corpus) -> list[float]:
    metrics = tmp_path / "local.jsonl"
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "2",
        "--steps",
        STEPS,
        "--metrics",
        metrics,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    return [r["loss"] for r in read_metrics(metrics)]


def _env(tmp_path, **extra) -> dict:
    return dict(
        os.environ,
        MESHWISE_CACHE=str(tmp_path / "cache"),
        PYTHONUNBUFFERED="1",
        OMP_NUM_THREADS="1",
        **extra,
    )


def test_two_launchers_on_loopback_match_one_machine(tmp_path, corpus):
    port = free_port()
    metrics = tmp_path / "nodes.jsonl"
    commands = [_node_command(n, "127.0.0.1", port, corpus, metrics) for n in (0, 1)]
    _run_nodes(commands, [_env(tmp_path)] * 2, tmp_path)
    assert [r["loss"] for r in read_metrics(metrics)] == pytest.approx(
        _reference(tmp_path, corpus), rel=1e-6
    )


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair (``benchmarks/two_nodes.py``)."""
    reason = unavailable()
    if reason:
        pytest.skip(
            f"two-namespace run not possible ({reason}); the loopback test covers the launch itself"
        )
    with TwoNodes() as nodes:
        yield nodes


def test_two_launchers_in_two_network_namespaces(tmp_path, corpus, two_hosts):
    metrics = tmp_path / "nodes.jsonl"
    commands, envs = [], []
    for node_rank, (ns, dev, _) in enumerate(two_hosts.hosts):
        commands.append(
            [
                "ip",
                "netns",
                "exec",
                ns,
                *_node_command(node_rank, two_hosts.hosts[0][2], 29500, corpus, metrics),
            ]
        )
        envs.append(_env(tmp_path, GLOO_SOCKET_IFNAME=dev))
    _run_nodes(commands, envs, tmp_path)
    assert [r["loss"] for r in read_metrics(metrics)] == pytest.approx(
        _reference(tmp_path, corpus), rel=1e-6
    )


@pytest.fixture
def two_shaped_hosts():
    """Two nodes of 2 ranks each behind a 200 Mbit/s link (netem, or tbf without it)."""
    reason = unavailable()
    if reason:
        pytest.skip(
            f"two-namespace run not possible ({reason}); without namespaces there is "
            "no slow link between nodes to measure"
        )
    with TwoNodes(rate="200mbit") as nodes:
        yield nodes


def test_hierarchical_beats_a_flat_ring_across_a_slow_link(tmp_path, two_shaped_hosts, monkeypatch):
    # Gloo's own formulation is what is timed (separate transfers each way; NCCL's rules
    # batch them, which gloo runs one direction after the other).
    monkeypatch.delenv("MESHWISE_COMM_CHECK", raising=False)
    done = two_shaped_hosts.run(
        [
            "bench",
            "comm",
            "--algorithms",
            "ring,hierarchical",
            "--sizes",
            "4M",
            "--repeats",
            "3",
            "--json",
        ],
        2,
        cwd=tmp_path,
    )
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    out = json.loads(done[0].stdout)
    assert out["world_size"] == 4 and out["nodes"] == 2
    times = {r["algorithm"]: r["time_s"] for r in out["results"]}
    # Ring: 6 steps of N/4 on the slow link each way = 1.5 N; hierarchical: N.
    assert times["hierarchical"] < 0.9 * times["ring"], times


def test_two_nodes_train_with_hierarchical_all_reduce(tmp_path, corpus, two_shaped_hosts):
    metrics = tmp_path / "nodes.jsonl"
    train = [
        "train",
        *map(str, SMALL),
        "--data",
        str(corpus),
        "--steps",
        str(STEPS),
        "--timeout-s",
        "60",
        "--metrics",
        str(metrics),
        "--allreduce",
        "hierarchical",
    ]
    done = two_shaped_hosts.run(train, 2, cwd=tmp_path)
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    records = read_metrics(metrics)
    assert records[-1]["allreduce_calls"].keys() == {"hierarchical"}  # 2 nodes of 2 from torchrun
    local = tmp_path / "local4.jsonl"
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "4",
        "--steps",
        STEPS,
        "--metrics",
        local,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert [r["loss"] for r in records] == pytest.approx(
        [r["loss"] for r in read_metrics(local)], rel=1e-4
    )


def _launch_two(tmp_path, corpus, flags_per_node, *flags):
    """Two launchers on loopback, each with its own extra flags; the Popen objects."""
    port = free_port()
    procs = []
    for node_rank, own in enumerate(flags_per_node):
        command = [
            _torchrun(),
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--node-rank",
            str(node_rank),
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(port),
            "-m",
            "meshwise",
            "train",
            *map(str, SMALL),
            "--data",
            str(corpus),
            "--dp",
            "2",
            *map(str, flags),
            *map(str, own),
        ]
        procs.append(
            subprocess.Popen(
                command,
                cwd=tmp_path,
                env=_env(tmp_path),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                start_new_session=True,
            )
        )
    return procs


def _end_all(procs, pids=()) -> None:
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    for pid in pids:
        if _alive(pid):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.timeout(150)
def test_a_killed_launcher_takes_its_rank_and_the_other_node_ends(tmp_path, corpus):
    metrics = tmp_path / "m.jsonl"
    procs = _launch_two(
        tmp_path, corpus, [[], []], "--steps", 100000, "--timeout-s", 20, "--metrics", metrics
    )
    ranks = []
    try:
        deadline = time.monotonic() + 90
        while metrics_written(metrics) < 2:
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), [
                p.stderr.read() for p in procs if p.poll() is not None
            ]
            time.sleep(0.05)  # polling the metrics file, not standing in for work
        out = subprocess.run(["pgrep", "-P", str(procs[1].pid)], capture_output=True, text=True)
        ranks = [int(pid) for pid in out.stdout.split()]
        assert ranks, "node 1 has no rank"
        os.kill(procs[1].pid, signal.SIGKILL)  # node 1's torchrun, as by the OOM killer
        killed = time.monotonic()
        while any(_alive(pid) for pid in ranks):
            assert time.monotonic() - killed < 5, "node 1's rank outlived its torchrun"
            time.sleep(0.05)
        _, err = procs[0].communicate(timeout=60)
        assert procs[0].returncode != 0
        assert time.monotonic() - killed < 25, "node 0 took longer than --timeout-s to end"
        assert "rank 0: lost its connection to another rank" in err, err
    finally:
        _end_all(procs, ranks)


@pytest.mark.timeout(150)
def test_nodes_resuming_different_checkpoints_stop_before_training(tmp_path, corpus):
    save = tmp_path / "ck"
    # A constant learning rate: a longer run continues the schedule it was saved under.
    result = run_cli(
        "train",
        *SMALL,
        "--data",
        corpus,
        "--dp",
        "2",
        "--steps",
        "4",
        "--save",
        save,
        "--save-every",
        "2",
        "--lr-schedule",
        "constant",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    procs = _launch_two(
        tmp_path,
        corpus,
        [["--resume", save / "step-00000004"], ["--resume", save / "step-00000002"]],
        "--steps",
        8,
        "--timeout-s",
        30,
        "--metrics",
        tmp_path / "m.jsonl",
        "--lr-schedule",
        "constant",
    )
    start = time.monotonic()
    try:
        errs = [p.communicate(timeout=100)[1] for p in procs]
    finally:
        _end_all(procs)
    assert time.monotonic() - start < 60
    for proc, err in zip(procs, errs):
        assert proc.returncode != 0
        assert "was started with checkpoint.resume_step = 2 but rank 0 with 4" in err, err
    assert not (tmp_path / "m.jsonl").exists() or not read_metrics(tmp_path / "m.jsonl")


def _readme_give_up_command() -> list[str]:
    """docs/multi-node.md's command for node 0 that gives up when node 1 never comes."""
    section = (Path(__file__).resolve().parents[2] / "docs" / "multi-node.md").read_text()
    block = section[section.index("```bash\n# node 0 alone") :]
    block = block[len("```bash\n") : block.index("```", 8)]
    lines = [
        line
        for line in block.replace("\\\n", " ").splitlines()
        if line.strip() and not line.startswith("#")
    ]
    return shlex.split(lines[0])


@pytest.mark.timeout(120)
def test_one_node_alone_gives_up_after_the_documented_timeout(tmp_path, corpus):
    command = _readme_give_up_command()
    assert command[0] == "torchrun" and "--rdzv-conf" in command
    rdzv = command[command.index("--rdzv-conf") + 1]
    given = dict(item.split("=") for item in rdzv.split(","))
    timeout_s = float(command[command.index("--timeout-s") + 1])
    assert float(given["timeout"]) == timeout_s  # torchrun gives up when meshwise would
    # The same command here: 1 rank per node, a short timeout, the small model on the CPU.
    wait = 6
    local = [
        _torchrun(),
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
        "--node-rank",
        "0",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        str(free_port()),
        "--rdzv-conf",
        f"timeout={wait}",
        "-m",
        "meshwise",
        "train",
        *map(str, SMALL),
        "--data",
        str(corpus),
        "--dp",
        "2",
        "--timeout-s",
        str(wait),
    ]
    start = time.monotonic()
    done = subprocess.run(
        local, cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=90
    )
    took = time.monotonic() - start
    assert done.returncode != 0
    assert wait <= took < wait + 20, took
    assert "1/2 clients joined" in done.stderr, done.stderr[-2000:]
