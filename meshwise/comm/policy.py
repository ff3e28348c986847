"""How each backend is asked for what meshwise needs: every choice of formulation, once.

Gloo (CPU) and NCCL (GPU) differ in which collective is fast, in what a
collective allocates and in whether a transfer overlaps compute, so a few
operations are formulated per backend. Each choice is one function here, with
the measurement behind it, and every caller asks it; no other module tests the
backend's name.
"""

from __future__ import annotations

from meshwise.comm import ops


def reduce_scatter_by_all_reduce(group: ops.Group) -> bool:
    """Whether a reduce-scatter over ``group`` runs as an all-reduce of which each
    rank keeps its own chunk.

    On gloo: its ``reduce_scatter_tensor`` is slower than its all-reduce (2
    ranks, 2 cores: 16 MiB 32.8 vs 21.2 ms, 64 MiB 121 vs 54 ms) and allocates
    a full-size temporary. On NCCL the reduce-scatter sends half the bytes.
    """
    return ops.backend(group) == "gloo"


def all_gather_by_all_reduce(group: ops.Group) -> bool:
    """Whether an all-gather over ``group`` runs as an all-reduce of a buffer in
    which every rank zeroes what it does not own (``x + 0`` is exact).

    On gloo: ``all_gather_into_tensor`` allocates a temporary as large as its
    output (26 MiB: +27 MiB peak RSS; the all-reduce allocates nothing), and
    ZeRO's gathers overlap each other and the next forward, so these
    temporaries would add up to most of a model; the speed is close (2 ranks,
    2 cores: 8 MiB 5.2 vs 7.6 ms, 25 MiB 21.1 vs 26.4 ms, 40 MiB 79.7 vs 43.4
    ms). On NCCL the all-gather sends half the bytes.
    """
    return ops.backend(group) == "gloo"


def overlapped_reductions(group: ops.Group) -> int:
    """How many gradient reductions may stay in flight while backward goes on
    (each holds a full gradient buffer of its unit).

    One, as FSDP2 allows, where the transfer overlaps compute (NCCL's own
    stream); none on gloo, whose transfer runs on the CPU cores the backward
    uses: waiting at once cost no step time on 2 cores (1.48 vs 1.51 s, 57M
    parameters) and saved a unit of peak memory (0.5 bytes per parameter there).
    """
    return 0 if ops.backend(group) in ("gloo", "local") else 1
