"""Each parameter's own initialisation, as its module's ``reset_parameters()`` draws it.

PyTorch's distributions (``nn.Linear`` uniform, ``nn.Embedding`` N(0, 1), norms ones and
zeros) drawn by ``meshwise.geometry.init``, not by PyTorch's generator, whose values depend
on construction order. Another module type with parameters needs an init function.
"""

from __future__ import annotations

import math

from torch import nn

from meshwise.geometry.init import ONES, ZEROS, Init, normal, uniform

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _module_inits(module: nn.Module) -> dict[str, Init] | None:
    """``{parameter attribute: Init}`` for a known module type; None if unknown."""
    if isinstance(module, nn.Linear):
        # kaiming_uniform_(a=sqrt(5)), nn.Linear's own, reduces to U(-1/sqrt(in), 1/sqrt(in))
        bound = 1.0 / math.sqrt(module.in_features) if module.in_features else 0.0
        return {"weight": uniform(bound), "bias": uniform(bound)}
    if isinstance(module, nn.Embedding):
        if module.padding_idx is not None:
            return None  # its padding row starts at zero: not one distribution
        return {"weight": normal(1.0)}
    if isinstance(module, _NORMS):
        return {"weight": ONES, "bias": ZEROS}
    return None


def default_inits(model: nn.Module) -> dict[str, Init]:
    """Every parameter of ``model`` (by its name in ``model``) -> its own initialisation.

    Raises ``ValueError`` naming a module whose type has parameters of its own
    but no known initialisation."""
    out: dict[str, Init] = {}
    for path, module in model.named_modules():
        own = [name for name, p in module.named_parameters(recurse=False)]
        if not own:
            continue
        inits = _module_inits(module) or {}
        missing = [name for name in own if name not in inits]
        if missing:
            where = f"{path}.{missing[0]}" if path else missing[0]
            raise ValueError(
                f"{where} ({type(module).__name__}) has no known default initialisation "
                "(known: nn.Linear, nn.Embedding without padding_idx, nn.LayerNorm, "
                "nn.RMSNorm, nn.GroupNorm); pass init_of(name) -> Init, e.g. "
                "meshwise.geometry.init.normal(0.02), ONES or ZEROS"
            )
        for name in own:
            out[f"{path}.{name}" if path else name] = inits[name]
    return out
