"""Two emulated nodes on this machine, each with its own torchrun launcher.

Two network namespaces joined by a veth pair, the link between the "nodes"
shaped with ``tc`` (netem delay and rate where the kernel has netem, else a
token-bucket rate limit), every rank's gloo bound to its namespace's end of the
link (``GLOO_SOCKET_IFNAME``). Ranks of one node talk over that namespace's own
loopback, so only inter-node traffic pays for the link, as on real machines.
Traffic stays on this machine: the addresses exist only inside the namespaces.

Needs root and ``ip netns`` (iproute2). Run a meshwise command on both nodes:

    python benchmarks/two_nodes.py --rate 200mbit -- bench comm --sizes 64K,1M,8M
    python benchmarks/two_nodes.py -- train --allreduce hierarchical --steps 20

(``--nproc-per-node`` ranks per node, 2 by default.) Node 0's output is printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import uuid

SUBNET = "10.213.7"  # only ever assigned inside the namespaces made here
MASTER_PORT = 29500


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None."""
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


def _run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True)


class TwoNodes:
    """Context manager: ``hosts`` is ``[(namespace, interface, address), ...]``; ``shaping``
    says what the link got (``None``: unshaped)."""

    def __init__(self, rate: str | None = None, delay: str | None = None):
        tag = uuid.uuid4().hex[:6]
        self.hosts = [
            (f"mw-a-{tag}", f"mwa{tag}", f"{SUBNET}.1"),
            (f"mw-b-{tag}", f"mwb{tag}", f"{SUBNET}.2"),
        ]
        self.rate, self.delay = rate, delay
        self.shaping: str | None = None

    def __enter__(self) -> "TwoNodes":
        (ns_a, dev_a, _), (ns_b, dev_b, _) = self.hosts
        steps = [
            ("ip", "netns", "add", ns_a),
            ("ip", "netns", "add", ns_b),
            ("ip", "link", "add", dev_a, "type", "veth", "peer", "name", dev_b),
        ]
        for ns, dev, addr in self.hosts:
            steps += [
                ("ip", "link", "set", dev, "netns", ns),
                ("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", dev),
                ("ip", "-n", ns, "link", "set", dev, "up"),
                ("ip", "-n", ns, "link", "set", "lo", "up"),
            ]
        try:
            for step in steps:
                done = _run(*step)
                if done.returncode:
                    raise RuntimeError(f"{' '.join(step)}: {done.stderr.strip()}")
            if self.rate or self.delay:
                self.shaping = self._shape()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _shape(self) -> str:
        """netem (delay + rate) on both ends of the link; without netem, tbf (rate only)."""
        notes = []
        for ns, dev, _ in self.hosts:
            netem = (
                ["netem"]
                + (["delay", self.delay] if self.delay else [])
                + (["rate", self.rate] if self.rate else [])
            )
            done = _run("ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", *netem)
            if done.returncode == 0:
                notes.append("netem")
                continue
            if not self.rate:
                raise RuntimeError(
                    f"tc netem failed ({done.stderr.strip()}) and no --rate for tbf to fall back on"
                )
            tbf = _run(
                "ip",
                "netns",
                "exec",
                ns,
                "tc",
                "qdisc",
                "add",
                "dev",
                dev,
                "root",
                "tbf",
                "rate",
                self.rate,
                "burst",
                "64kb",
                "latency",
                "200ms",
            )
            if tbf.returncode:
                raise RuntimeError(
                    f"tc could not shape the link: netem: {done.stderr.strip()}; "
                    f"tbf: {tbf.stderr.strip()}"
                )
            notes.append(f"tbf (netem unavailable: {done.stderr.strip()})")
        how = notes[0]
        if how == "netem":
            return f"netem: delay {self.delay or '0'}, rate {self.rate or 'unlimited'}, each way"
        return f"{how}: rate {self.rate} each way, no added delay"

    def __exit__(self, *exc) -> None:
        for ns, _, _ in self.hosts:
            _run("ip", "netns", "del", ns)  # takes its end of the veth pair with it

    def commands(
        self, argv: list[str], nproc_per_node: int = 2, port: int = MASTER_PORT
    ) -> list[tuple[list[str], dict]]:
        """One ``(command, env)`` per node: torchrun in its namespace, the README's form."""
        torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which(
            "torchrun"
        )
        master = self.hosts[0][2]
        out = []
        for node_rank, (ns, dev, _) in enumerate(self.hosts):
            cmd = [
                "ip",
                "netns",
                "exec",
                ns,
                torchrun,
                "--nnodes",
                "2",
                "--nproc-per-node",
                str(nproc_per_node),
                "--node-rank",
                str(node_rank),
                "--master-addr",
                master,
                "--master-port",
                str(port),
                "-m",
                "meshwise",
                *argv,
            ]
            out.append(
                (
                    cmd,
                    dict(
                        os.environ,
                        GLOO_SOCKET_IFNAME=dev,
                        OMP_NUM_THREADS="1",
                        PYTHONUNBUFFERED="1",
                    ),
                )
            )
        return out

    def run(
        self, argv: list[str], nproc_per_node: int = 2, timeout_s: float = 300, cwd=None
    ) -> list[subprocess.CompletedProcess]:
        """Run ``meshwise ARGV`` on both nodes at once; the two completed processes."""
        procs = [
            subprocess.Popen(
                cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for cmd, env in self.commands(argv, nproc_per_node)
        ]
        try:
            outs = [p.communicate(timeout=timeout_s) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
        return [
            subprocess.CompletedProcess(p.args, p.returncode, out, err)
            for p, (out, err) in zip(procs, outs)
        ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", default="200mbit", help="link rate each way (tc syntax)")
    parser.add_argument("--delay", default=None, help="added one-way delay (needs netem)")
    parser.add_argument("--nproc-per-node", type=int, default=2)
    parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- then a meshwise command")
    args = parser.parse_args()
    argv = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
    reason = unavailable()
    if reason:
        print(f"two_nodes: cannot emulate two nodes here: {reason}", file=sys.stderr)
        return 2
    with TwoNodes(args.rate, args.delay) as nodes:
        print(f"two nodes of {args.nproc_per_node} ranks; link: {nodes.shaping or 'unshaped'}")
        results = nodes.run(argv, args.nproc_per_node)
    print(results[0].stdout, end="")
    for node, result in enumerate(results):
        if result.returncode:
            print(f"node {node} exited {result.returncode}:\n{result.stderr}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
