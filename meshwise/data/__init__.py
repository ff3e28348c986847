"""Data: readers, tokenizers, token files, and the deterministic global batches (docs/data.md)."""
