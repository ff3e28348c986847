"""Each parameter's own initialisation, as its module's ``reset_parameters()`` draws it.

A model built on the meta device holds shapes only, so its values come later,
from ``meshwise.layout.init``: drawn block by block from the seed, the same
whatever the layout. Without an init function of the user's, a parameter gets
the distribution its module type gives it in PyTorch:

- ``nn.Linear``: weight and bias U(-1/sqrt(in_features), 1/sqrt(in_features))
  (``kaiming_uniform_(a=sqrt(5))`` reduces to that bound);
- ``nn.Embedding``: N(0, 1);
- ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``: weight ones, bias zeros.

The distribution matches PyTorch's; the values are meshwise's own draws (PyTorch's
global generator depends on construction order, which a layout cannot keep). A
module type not listed here with parameters of its own has no known default:
the caller is told to give an init function.
"""

from __future__ import annotations

import math

from torch import nn

from meshwise.layout.init import ONES, ZEROS, Init, normal, uniform

_NORMS = (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm)


def _module_inits(module: nn.Module) -> dict[str, Init] | None:
    """``{parameter attribute: Init}`` for a known module type; None if unknown."""
    if isinstance(module, nn.Linear):
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
                "meshwise.layout.init.normal(0.02), ONES or ZEROS")
        for name in own:
            out[f"{path}.{name}" if path else name] = inits[name]
    return out
