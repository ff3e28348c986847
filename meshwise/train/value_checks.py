"""Checks of one setting's value, shared by ``config`` and ``layout_rules``: each raises
``ValueError`` naming the flag, the bad value and what would be valid.
"""

from __future__ import annotations

import math


def flag_name(field: str) -> str:
    """The ``meshwise train`` flag of a settings field (``n_kv_head`` -> ``--n-kv-head``)."""
    return "--" + field.replace("_", "-")


def positive(**values) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value > 0):  # NaN compares False: caught here
            raise ValueError(f"{flag_name(name)} must be a finite number > 0, got {value}")


def non_negative(**values) -> None:
    for name, value in values.items():
        if not (math.isfinite(value) and value >= 0):
            raise ValueError(f"{flag_name(name)} must be a finite number >= 0, got {value}")


def choice(flag: str, value, valid) -> None:
    if value not in valid:
        raise ValueError(
            f"{flag} {value!r} is not valid; valid: {', '.join(str(v) for v in valid)}"
        )
