"""AdamW on flat tensors (pure functions).

Every optimizer path in meshwise (plain data parallel, ZeRO 1/2/3) hands the
parameters (or parts of them) it owns to ``adamw_update``, so the update is the
same arithmetic whatever the layout: ``torch.optim.AdamW``'s (Loshchilov &
Hutter 2019: decoupled weight decay, Adam's bias correction), computed by
PyTorch's fused AdamW kernel through its public functional API
(``torch.optim.adamw.adamw(fused=True)``): one pass over parameters,
gradients and both moments, on the CPU and on CUDA, where the same arithmetic
written as separate tensor operations reads and writes each element about a
dozen times.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as _torch_adamw


@dataclass(frozen=True)
class AdamWConfig:
    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1


@torch.no_grad()
def adamw_update(
    params: list[torch.Tensor],
    grads: list[torch.Tensor],
    exp_avgs: list[torch.Tensor],
    exp_avg_sqs: list[torch.Tensor],
    step: int,
    lr: float,
    cfg: AdamWConfig,
    weight_decay: float | None = None,
    grad_scale=1.0,
    skip: torch.Tensor | None = None,
) -> None:
    """One AdamW step in place on each ``params[i]`` (all of one dtype and device),
    gradients times ``grad_scale`` (a number or a 0-dim tensor on the device: the
    clipping factor). ``step`` is 1-based; ``weight_decay`` overrides ``cfg``'s.

    The gradients are left multiplied by ``grad_scale``. ``skip``: a 0-dim bool
    tensor on the device; where true, the step changes nothing (the kernel reads it
    on the device and returns: no host read), whatever the gradients hold.
    """
    if not params:
        return
    dtype, device = params[0].dtype, params[0].device
    unscale = None
    if torch.is_tensor(grad_scale) or grad_scale != 1.0:
        if dtype == torch.float32:
            # The kernel divides by a float32 scale as it reads the gradient: clipping
            # costs no pass of its own (g / fp32(1 / c): within an ulp of g * c).
            if torch.is_tensor(grad_scale):
                unscale = grad_scale.reciprocal().to(device, torch.float32).reshape(())
            else:  # filled on the device: a tensor copied from the host would sync CUDA
                unscale = torch.full((), 1.0 / grad_scale, dtype=torch.float32, device=device)
        else:  # a float32 divisor would round float64 gradients: scale them exactly
            for grad in grads:
                grad.mul_(grad_scale)
    found_inf = None if skip is None else skip.to(device=device, dtype=torch.float32)
    # The functional API counts steps in tensors, adding one before the update (and
    # taking ``found_inf`` off after it): fresh ones, one per tensor, at ``step - 1``.
    steps = list(torch.full((len(params),), step - 1, dtype=torch.float32, device=device).unbind())
    beta1, beta2 = cfg.betas
    _torch_adamw(
        params,
        grads,
        exp_avgs,
        exp_avg_sqs,
        [],
        steps,
        fused=True,
        grad_scale=unscale,
        found_inf=found_inf,
        amsgrad=False,
        beta1=beta1,
        beta2=beta2,
        lr=lr,
        weight_decay=cfg.weight_decay if weight_decay is None else weight_decay,
        eps=cfg.eps,
        maximize=False,
    )


def decays(name: str, param: torch.Tensor) -> bool:
    """Weight decay applies to matrices, not to biases, norms or other vectors."""
    return param.dim() >= 2


def squared_sum(t: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """Sum of squares in float64, accurate and fast.

    One fp32 norm over millions of elements drifts (4M: 1.6e-4 relative) and
    ``vector_norm(dtype=float64)`` is 60x slower on CPU; fp32 norms of 8192-element
    rows combined in float64 are both accurate (~1e-8) and fast.
    """
    head = t.numel() // chunk * chunk
    rows = torch.linalg.vector_norm(t[:head].view(-1, chunk), dim=1)  # (head / chunk,)
    tail = torch.linalg.vector_norm(t[head:]).reshape(1)
    return torch.cat([rows, tail]).to(torch.float64).square().sum()
