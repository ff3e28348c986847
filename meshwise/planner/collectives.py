"""What one collective costs over a link model (Hockney's alpha-beta per message).

A collective is also a meeting: each rank waits there for peers whose compute since
the last one ran slower (``sync_wait_s``), which a probe of back-to-back calls
never sees and a CPU shared with other work shows most.

A ring over ``p`` ranks moves a tensor of ``n`` bytes in ``p - 1`` steps of
``n / p`` (reduce-scatter, all-gather) or ``2 (p - 1)`` (all-reduce; Thakur
et al. 2005), each step ``alpha + (n / p) beta`` on the slowest link the ring
crosses. On gloo meshwise runs reduce-scatter and all-gather as all-reduces
(``meshwise.comm.policy``), and a measured all-reduce per group size replaces
the ring's estimate where the calibration holds one.
"""

from __future__ import annotations

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
    measured = device.all_reduce.get(size) if link == "intra" else None
    if device.collectives_as_all_reduce:
        kind = "all_reduce"
    if measured is not None and kind == "all_reduce":
        return measured.time(nbytes) * device.collective_factor.get(kind, 1.0)
    step = device.link(link)
    steps = 2 * (size - 1) if kind == "all_reduce" else size - 1
    return steps * step.time(nbytes / size) * device.collective_factor.get(kind, 1.0)


def p2p_s(device: DeviceProfile, nbytes: float, link: str) -> float:
    """One message of ``nbytes`` between two ranks."""
    return device.link(link).time(nbytes) if nbytes > 0 else 0.0


def sync_wait_s(device: DeviceProfile, size: int, syncs: float, compute_s: float) -> float:
    """What a rank waits at ``syncs`` blocking collectives of a group of ``size`` ranks,
    spread evenly over ``compute_s`` seconds of its compute, for peers that drifted behind
    since the last one: ``drift x sqrt(compute between two)`` each, so ``drift x
    sqrt(syncs x compute_s)`` in all (``DeviceProfile.drift``)."""
    if size <= 1 or syncs <= 0 or compute_s <= 0:
        return 0.0
    return device.drift_at(size) * (syncs * compute_s) ** 0.5
