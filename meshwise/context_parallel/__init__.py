"""Context parallelism: every sequence split across the cp ranks (load-balanced
zigzag chunks), attention over the whole of it by a ring of key/value blocks
(``ring``), each block's attention and its log-sum-exp (``blocks``), and the
positions of a rank's tokens (``positions``)."""
