"""Device helpers that never touch an accelerator's API unless the device is one."""

from __future__ import annotations

import torch


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
