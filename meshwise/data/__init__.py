"""Data: corpora, token files, tokenizers and the deterministic global batches.

``dataset`` turns what the user gave into a token file (cached) and draws
global batches from it; ``corpus`` encodes text in worker processes;
``token_files`` is the on-disk format; ``tokenizer`` and ``bpe`` are the
tokenizers.
"""
