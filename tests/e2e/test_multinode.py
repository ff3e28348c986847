"""Two ``torchrun`` launchers, as on two machines, running the README's commands.

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
import shutil
import subprocess
import sys

import pytest

from benchmarks.two_nodes import TwoNodes, unavailable
from meshwise.cli.launch import free_port
from tests.e2e.conftest import SMALL, read_metrics, run_cli

STEPS = 6


def _torchrun() -> str:
    beside = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    path = beside or shutil.which("torchrun")
    if path is None:
        pytest.skip("torchrun is not installed beside this Python")
    return path


def _node_command(node_rank: int, master: str, port: int, corpus, metrics) -> list[str]:
    return [_torchrun(), "--nnodes", "2", "--nproc-per-node", "1", "--node-rank", str(node_rank),
            "--master-addr", master, "--master-port", str(port),
            "-m", "meshwise", "train", *map(str, SMALL), "--data", str(corpus), "--dp", "2",
            "--steps", str(STEPS), "--timeout-s", "60", "--metrics", str(metrics)]


def _run_nodes(commands, envs, cwd) -> None:
    procs = [subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for cmd, env in zip(commands, envs)]
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
    result = run_cli("train", *SMALL, "--data", corpus, "--dp", "2", "--steps", STEPS,
                     "--metrics", metrics, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    return [r["loss"] for r in read_metrics(metrics)]


def _env(tmp_path, **extra) -> dict:
    return dict(os.environ, MESHWISE_CACHE=str(tmp_path / "cache"), PYTHONUNBUFFERED="1",
                OMP_NUM_THREADS="1", **extra)


def test_two_launchers_on_loopback_match_one_machine(tmp_path, corpus):
    port = free_port()
    metrics = tmp_path / "nodes.jsonl"
    commands = [_node_command(n, "127.0.0.1", port, corpus, metrics) for n in (0, 1)]
    _run_nodes(commands, [_env(tmp_path)] * 2, tmp_path)
    assert [r["loss"] for r in read_metrics(metrics)] == pytest.approx(
        _reference(tmp_path, corpus), rel=1e-6)


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair (``benchmarks/two_nodes.py``)."""
    reason = unavailable()
    if reason:
        pytest.skip(f"two-namespace run not possible ({reason}); the loopback test covers "
                    "the launch itself")
    with TwoNodes() as nodes:
        yield nodes


def test_two_launchers_in_two_network_namespaces(tmp_path, corpus, two_hosts):
    metrics = tmp_path / "nodes.jsonl"
    commands, envs = [], []
    for node_rank, (ns, dev, _) in enumerate(two_hosts.hosts):
        commands.append(["ip", "netns", "exec", ns,
                         *_node_command(node_rank, two_hosts.hosts[0][2], 29500, corpus,
                                        metrics)])
        envs.append(_env(tmp_path, GLOO_SOCKET_IFNAME=dev))
    _run_nodes(commands, envs, tmp_path)
    assert [r["loss"] for r in read_metrics(metrics)] == pytest.approx(
        _reference(tmp_path, corpus), rel=1e-6)


@pytest.fixture
def two_shaped_hosts():
    """Two nodes of 2 ranks each behind a 200 Mbit/s link (netem, or tbf without it)."""
    reason = unavailable()
    if reason:
        pytest.skip(f"two-namespace run not possible ({reason}); without namespaces there is "
                    "no slow link between nodes to measure")
    with TwoNodes(rate="200mbit") as nodes:
        yield nodes


def test_hierarchical_beats_a_flat_ring_across_a_slow_link(tmp_path, two_shaped_hosts,
                                                           monkeypatch):
    # Gloo's own formulation is what is timed (separate transfers each way; NCCL's rules
    # batch them, which gloo runs one direction after the other).
    monkeypatch.delenv("MESHWISE_COMM_CHECK", raising=False)
    done = two_shaped_hosts.run(["bench", "comm", "--algorithms", "ring,hierarchical",
                                 "--sizes", "4M", "--repeats", "3", "--json"], 2, cwd=tmp_path)
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    out = json.loads(done[0].stdout)
    assert out["world_size"] == 4 and out["nodes"] == 2
    times = {r["algorithm"]: r["time_s"] for r in out["results"]}
    # Ring: 6 steps of N/4 on the slow link each way = 1.5 N; hierarchical: N.
    assert times["hierarchical"] < 0.9 * times["ring"], times


def test_two_nodes_train_with_hierarchical_all_reduce(tmp_path, corpus, two_shaped_hosts):
    metrics = tmp_path / "nodes.jsonl"
    train = ["train", *map(str, SMALL), "--data", str(corpus), "--steps", str(STEPS),
             "--timeout-s", "60", "--metrics", str(metrics), "--allreduce", "hierarchical"]
    done = two_shaped_hosts.run(train, 2, cwd=tmp_path)
    assert all(d.returncode == 0 for d in done), [d.stderr for d in done]
    records = read_metrics(metrics)
    assert records[-1]["allreduce_calls"].keys() == {"hierarchical"}  # 2 nodes of 2 from torchrun
    local = tmp_path / "local4.jsonl"
    result = run_cli("train", *SMALL, "--data", corpus, "--dp", "4", "--steps", STEPS,
                     "--metrics", local, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert [r["loss"] for r in records] == pytest.approx(
        [r["loss"] for r in read_metrics(local)], rel=1e-4)
