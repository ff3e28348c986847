"""``MeshwiseError``: a mistake in what meshwise was asked to do, said in one line.

It lives on the bottom floor so that every wing may raise it.
"""

from __future__ import annotations


class MeshwiseError(ValueError):
    """A user's mistake (a bad value, a plan that does not fit its model): the message
    names it and what would be valid, and is the whole report. A ``ValueError``, so
    ``except ValueError`` catches it as before."""
