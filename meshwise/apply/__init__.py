"""Parallelism applied to a plain model by its plan (torchtitan's order).

``parallelize`` cuts the pipeline stages, swaps in the tensor-parallel layers,
ties parameters across stages and names each parameter's logical piece;
``activation_checkpointing`` wraps the layers. The model's own code is left
alone.
"""
