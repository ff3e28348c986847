"""Context parallelism: sequences split over the cp ranks in zigzag chunks, attention as a
ring of key/value blocks (``ring``), each block with its log-sum-exp (``blocks``).
"""
