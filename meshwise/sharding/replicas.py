"""Hybrid sharding's promise, checked: every replica holds bitwise the same parameters
(the cross-replica all-reduce hands each replica the same sum, so the same update)."""

from __future__ import annotations

import torch

from meshwise.comm import ops


@torch.no_grad()
def replica_fingerprint(flats) -> torch.Tensor:
    """One int64 per flat buffer from the bits of this rank's master values, each element
    weighted by its place: equal on two ranks when their values are bitwise equal."""
    sums = []
    for flat in flats:
        master = flat.master.contiguous()
        bits = master.view(torch.int64 if master.element_size() == 8 else torch.int32)
        place = torch.arange(bits.numel(), device=bits.device, dtype=torch.int64) % 65521 + 1
        sums.append((bits.to(torch.int64) * place).sum())
    return torch.stack(sums)


def check_replicas_equal(flats, replicate_group) -> None:
    """Raise, naming the buffers, if this shard's values differ across the replicas."""
    mine = replica_fingerprint(flats)
    low, high = mine.clone(), mine.clone()
    ops.all_reduce(low, replicate_group, op="min", category="check")
    ops.all_reduce(high, replicate_group, op="max", category="check")
    bad = (low != high).nonzero().flatten().tolist()  # a debug check: one host read
    if bad:
        names = [flats[i].slots[0].name for i in bad]
        raise RuntimeError(
            f"replicas of --dp-shard hold different parameter values (buffers starting "
            f"at {', '.join(names)}): their gradients were not summed alike"
        )
