"""The test processes' fork server: the end-to-end runs (``tests.e2e.forked_cli``) and
the gloo rank pools (``tests.dist.pool``) fork from one process that has imported torch,
the CLI and the trainer once, so each starts without an interpreter's and torch's
start-up (seconds of CPU each on a small machine).

The server runs no torch op, as ``meshwise`` does before forking its own CPU ranks.
Python has one fork server per process, started on first use with the preload list set
then, so every user asks for it here with the same list.
"""

from __future__ import annotations

import multiprocessing

PRELOAD = ["meshwise.cli.main", "meshwise.train.trainer", "tests.e2e.forked_cli", "tests.dist.pool"]


def context():
    """The ``forkserver`` multiprocessing context with the shared preload list."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx
