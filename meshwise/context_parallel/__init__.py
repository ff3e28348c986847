"""Context parallelism: every sequence split across the cp ranks (load-balanced
zigzag chunks, ``meshwise.layout.sequence``), attention over the whole of it by
a ring of key/value blocks (``ring``), and each block's attention and its
log-sum-exp (``blocks``)."""
