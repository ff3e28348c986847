"""Checkpoints on disk: store and load flat runs whatever the layout, resume, prune.

It knows pieces of logical tensors and flat runs (``meshwise.layout``), never a
model, a plan or a layer class.
"""
