"""Plain single-device models (GPT, Llama), each with its ``ParallelPlan``; ``families`` is
the registry the trainer, checkpoints and export look them up in.
"""
