"""The face: the ``meshwise`` command line (``main``, one module per command) and the
launcher of ranks (``launch``). No library package imports this one.
"""
