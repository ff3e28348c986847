"""Named ranges in ``torch.profiler`` traces (``named``), free when no trace is recorded.

Off, ``named`` returns one shared null context: no allocation, no profiler call.
"""

from __future__ import annotations

import contextlib

import torch

_NULL = contextlib.nullcontext()
_RECORDING = [False]  # the process's profiler is on; one flag, like torch's own


def recording(on: bool) -> None:
    """Mark ranges from now on (``True``) or stop (``False``)."""
    _RECORDING[0] = on


def named(name: str):
    """A context naming its work ``meshwise/<name>`` in a trace (a null one when off)."""
    if not _RECORDING[0]:
        return _NULL
    return torch.profiler.record_function(f"meshwise/{name}")
