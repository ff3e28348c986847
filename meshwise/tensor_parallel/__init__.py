"""Megatron-style tensor parallelism: the f/g mappings, column, row and vocabulary layers."""
