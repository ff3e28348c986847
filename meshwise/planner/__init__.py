"""Which layout to run: memory and step time predicted per layout (``meshwise plan``)."""
