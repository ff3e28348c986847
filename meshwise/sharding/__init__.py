"""Data parallelism and ZeRO 0-3 on one flat-buffer core (``flat``), with a sharded AdamW."""
