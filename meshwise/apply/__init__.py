"""Parallelism applied to a plain model by its plan, in torchtitan's order, leaving the
model's code alone: ``parallelize``, then ``activation_checkpointing``.
"""
