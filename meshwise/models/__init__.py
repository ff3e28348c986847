"""Plain single-device models (GPT, Llama), each with its ``ParallelPlan``.

``families`` is the registry the trainer, checkpoints and export look models up in.
"""
