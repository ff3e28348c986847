"""The face: the ``meshwise`` command line and the launcher of ranks.

``main`` parses and hands over to one module per command (``train``, ``data``,
``schedule``, ``bench``, ``export``, ``generate``); ``launch`` starts the ranks
of a job (spawned locally, or joined to torchrun's). No library package imports
this one.
"""
