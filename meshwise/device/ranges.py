"""Named ranges in ``torch.profiler`` traces, free when no trace is being recorded.

The forward, backward, optimizer step, pipeline actions, ZeRO-3 gathers,
checkpoint saves and every collective (named by its group, so each axis's
communication shows as such) are marked with ``named(name)``. While no trace
is recorded ``named`` returns one shared null context: no allocation, no call
into the profiler. Whether a trace is being recorded is one switch per process,
as torch's profiler itself is (``recording``).
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
