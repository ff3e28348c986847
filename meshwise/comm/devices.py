"""Which device a rank computes on, and waiting for it.

Nothing here touches an accelerator's API unless the device is one.
"""

from __future__ import annotations

import os

import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; others as given."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def rank_device(kind: str) -> torch.device:
    """The device this rank computes on: the CPU, or for ``cuda`` its local rank's GPU.

    ``LOCAL_RANK`` (set by ``meshwise train`` and by torchrun) indexes the GPUs
    this process sees, which ``CUDA_VISIBLE_DEVICES`` has already renumbered.
    Where a scheduler shows each process only its own GPU, that one GPU is the
    rank's whatever its ``LOCAL_RANK``.
    """
    if kind != "cuda":
        return torch.device(kind)
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    visible = torch.cuda.device_count()
    if visible == 1:
        return torch.device("cuda", 0)
    if local_rank >= visible:
        raise RuntimeError(f"LOCAL_RANK {local_rank} but this process sees {visible} GPUs "
                           f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}); "
                           "start at most one rank per visible GPU on each node")
    return torch.device("cuda", local_rank)


def synchronize(device: torch.device | str) -> None:
    """Wait until the work queued on ``device`` has finished; a no-op on CPU.

    Accelerators run kernels asynchronously: a clock read right after a step
    measures how fast the host queued it, not how long it ran. Read clocks after
    this.
    """
    device = torch.device(device)
    if device.type in ("cpu", "meta"):
        return
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return
    backend = getattr(torch, device.type, None)  # e.g. torch.xpu, torch.mps
    if backend is None or not hasattr(backend, "synchronize"):
        raise ValueError(f"cannot wait for device {device}: torch.{device.type}.synchronize "
                         "does not exist")
    backend.synchronize()
