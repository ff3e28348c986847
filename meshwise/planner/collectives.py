"""What one collective costs over a link model (Hockney's alpha-beta; ring steps as Thakur
et al. 2005 count them), and the wait for peers that drifted behind (``sync_wait_s``),
which back-to-back probes never see.
"""

from __future__ import annotations

import functools
import math

from meshwise.planner.devices import DeviceProfile


def link_kind(stride: int, size: int, ranks_per_node: int) -> str:
    """``intra`` when a group of ``size`` ranks ``stride`` apart sits in one node."""
    if ranks_per_node <= 0 or size <= 1:
        return "intra"
    return "intra" if stride * size <= ranks_per_node else "inter"


def collective_s(device: DeviceProfile, kind: str, nbytes: float, size: int, link: str) -> float:
    """Seconds of one ``kind`` (``all_reduce``, ``reduce_scatter``, ``all_gather``) of a
    tensor of ``nbytes`` over ``size`` ranks on ``link``."""
    if size <= 1 or nbytes <= 0:
        return 0.0
    # gloo runs gathers and reduce-scatters as all-reduces (meshwise.comm.policy), and a
    # calibrated all-reduce of this group size replaces the ring's estimate.
    measured = device.all_reduce.get(size) if link == "intra" else None
    if device.collectives_as_all_reduce:
        kind = "all_reduce"
    if measured is not None and kind == "all_reduce":
        return measured.time(nbytes) * device.collective_factor.get(kind, 1.0)
    step = device.link(link)  # a ring step: n / p bytes over the slowest link it crosses
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    return steps * step.time(nbytes / size) * device.collective_factor.get(kind, 1.0)


def p2p_s(device: DeviceProfile, nbytes: float, link: str) -> float:
    """One message of ``nbytes`` between two ranks."""
    return device.link(link).time(nbytes) if nbytes > 0 else 0.0


def sync_wait_s(
    device: DeviceProfile, size: int, syncs: float, compute_s: float, world: int
) -> float:
    """What a rank waits at ``syncs`` blocking collectives of ``size`` ranks, spread over
    ``compute_s`` of its compute: ``drift x sqrt(syncs x compute_s)`` (``DeviceProfile.drift``).

    A collective waits for the slowest of its group: a drift measured on ``n`` ranks scales by
    ``max_of(size) / max_of(n)``. On a CPU the job's ``world`` ranks share the cores, which sets
    the base drift whatever the group.
    """
    if size <= 1 or syncs <= 0 or compute_s <= 0:
        return 0.0
    drift, measured_on = device.drift_at(world if device.cores is not None else size)
    if drift == 0:
        return 0.0
    return drift * expected_max(size) / expected_max(measured_on) * (syncs * compute_s) ** 0.5


@functools.lru_cache(maxsize=64)
def expected_max(n: int) -> float:
    """The expected maximum of ``n`` independent standard normal values (0.564 for 2,
    1.029 for 4), by the trapezoid rule over ``n x phi(x) x Phi(x)^(n-1)``."""
    step, total = 0.01, 0.0
    for i in range(-1000, 1001):
        x = i * step
        pdf = math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        total += x * n * pdf * (0.5 * (1 + math.erf(x / math.sqrt(2)))) ** (n - 1) * step
    return max(total, 1e-9)
