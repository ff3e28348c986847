"""How each backend is asked for what meshwise needs: every choice of formulation, once.

gloo and NCCL differ in which collective is fast, what it allocates, what overlaps and
what is allowed; each choice is one function here with its measurement, and no other
module tests the backend's name. Strict mode formulates every group as for NCCL.
"""

from __future__ import annotations

from meshwise.comm import ops
from meshwise.comm.checks import strict


def _formulation(group: ops.Group) -> str:
    """The backend whose formulations ``group`` gets: NCCL's in strict mode."""
    name = ops.backend(group)
    return "nccl" if name != "local" and strict.enabled() else name


def reduce_scatter_by_all_reduce(group: ops.Group) -> bool:
    """Whether a reduce-scatter over ``group`` runs as an all-reduce of which each
    rank keeps its own chunk."""
    # gloo's reduce_scatter_tensor is slower than its all-reduce (2 ranks, 2 cores:
    # 16 MiB 32.8 vs 21.2 ms, 64 MiB 121 vs 54 ms) and allocates a full-size
    # temporary. On NCCL the reduce-scatter sends half the bytes.
    return _formulation(group) == "gloo"


def all_gather_by_all_reduce(group: ops.Group) -> bool:
    """Whether an all-gather over ``group`` runs as an all-reduce of a buffer in
    which every rank zeroes what it does not own (``x + 0`` is exact)."""
    # gloo's all_gather_into_tensor allocates a temporary as large as its output
    # (26 MiB: +27 MiB peak RSS; the all-reduce allocates nothing), and ZeRO's
    # gathers overlap each other and the next forward, so these temporaries would
    # add up to most of a model; the speed is close (2 ranks, 2 cores: 8 MiB 5.2 vs
    # 7.6 ms, 25 MiB 21.1 vs 26.4 ms, 40 MiB 79.7 vs 43.4 ms). On NCCL the
    # all-gather sends half the bytes.
    return _formulation(group) == "gloo"


def overlapped_reductions(group: ops.Group) -> int:
    """How many gradient reductions may stay in flight while backward goes on
    (each holds a full gradient buffer of its unit)."""
    # One, as FSDP2 allows, where the transfer overlaps compute (NCCL's own stream);
    # none on gloo, whose transfer runs on the CPU cores the backward uses: waiting
    # at once cost no step time on 2 cores (1.48 vs 1.51 s, 57M parameters) and
    # saved a unit of peak memory (0.5 bytes per parameter there).
    return 0 if _formulation(group) in ("gloo", "local") else 1


def transfers_in_batches(group: ops.Group) -> bool:
    """Whether an exchange (send to one peer, receive from another) is posted as one
    batch (``ops.batch_p2p``) rather than as separate transfers."""
    # NCCL needs the batch: unbatched transfers with one peer share a stream and
    # block it until matched, so two ranks that both receive first deadlock. Gloo
    # runs a batch's transfers one after the other, which halves an exchange's speed
    # on a full-duplex link (4 MiB each way over 200 Mbit/s: 280-350 ms batched,
    # 180 ms separate, 125 ms one way), so it gets separate transfers.
    return _formulation(group) != "gloo"


def reduce_in_background(group: ops.Group) -> bool:
    """Whether gradient reductions with our algorithms or compression (a chain of
    transfers and arithmetic driven by the host) run on a thread of their own."""
    # On gloo that thread is what lets the reduction overlap the rest of backward.
    # NCCL allows one issuing thread per communicator, and its transfers do not hold
    # the host: the chain is issued from the training thread, on a CUDA stream of
    # its own so the backward's kernels are not queued behind it.
    return _formulation(group) == "gloo"
