"""Two ``torchrun`` launchers, as on two machines, running the README's commands.

With root and ``ip netns``, each launcher lives in its own network namespace
(its own interfaces and loopback), the two joined by a veth pair: the ranks
must find each other across that link, as across two hosts, which needs
``GLOO_SOCKET_IFNAME``. Otherwise both launchers share this machine's loopback.
Either way the two-node job must give the per-step losses of ``--dp 2`` on one
machine.
"""

import os
import shutil
import subprocess
import sys
import uuid

import pytest

from meshwise.launch import free_port
from tests.e2e.conftest import SMALL, read_metrics, run_cli

STEPS = 6
SUBNET = "10.213.7"  # addresses of the two test namespaces only, on their own veth link


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


def _netns_unavailable() -> str | None:
    if os.geteuid() != 0:
        return "not root: cannot create network namespaces"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"mw-probe-{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@pytest.fixture
def two_hosts():
    """Two namespaces joined by a veth pair: ``[(namespace, interface, address), ...]``."""
    reason = _netns_unavailable()
    if reason:
        pytest.skip(f"two-namespace run not possible ({reason}); the loopback test covers "
                    "the launch itself")
    tag = uuid.uuid4().hex[:6]
    hosts = [(f"mw-a-{tag}", f"mwa{tag}", f"{SUBNET}.1"), (f"mw-b-{tag}", f"mwb{tag}",
                                                             f"{SUBNET}.2")]
    steps = [["ip", "netns", "add", hosts[0][0]], ["ip", "netns", "add", hosts[1][0]],
             ["ip", "link", "add", hosts[0][1], "type", "veth", "peer", "name", hosts[1][1]]]
    for ns, dev, addr in hosts:
        steps += [["ip", "link", "set", dev, "netns", ns],
                  ["ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev],
                  ["ip", "-n", ns, "link", "set", dev, "up"],
                  ["ip", "-n", ns, "link", "set", "lo", "up"]]
    try:
        for step in steps:
            subprocess.run(step, check=True, capture_output=True)
        yield hosts
    finally:
        for ns, _, _ in hosts:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_two_launchers_in_two_network_namespaces(tmp_path, corpus, two_hosts):
    metrics = tmp_path / "nodes.jsonl"
    master = two_hosts[0][2]
    commands, envs = [], []
    for node_rank, (ns, dev, _) in enumerate(two_hosts):
        commands.append(["ip", "netns", "exec", ns,
                         *_node_command(node_rank, master, 29500, corpus, metrics)])
        envs.append(_env(tmp_path, GLOO_SOCKET_IFNAME=dev))
    _run_nodes(commands, envs, tmp_path)
    assert [r["loss"] for r in read_metrics(metrics)] == pytest.approx(
        _reference(tmp_path, corpus), rel=1e-6)
