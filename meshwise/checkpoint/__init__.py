"""Checkpoints on disk: flat runs stored and loaded whatever the layout, resume, prune
(docs/checkpoints.md). It knows pieces and flat runs, never a model, plan or layer.
"""
