"""NCCL's rules checked on any backend (``strict``), the collective ledger each rank
keeps (``ledger``), compared across ranks (``watchdog``, ``context``) and read side
by side after a failure (``diagnose``)."""
