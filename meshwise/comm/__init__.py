"""Communication: ``ops`` is the only caller of ``torch.distributed``; the rest builds on it.

The wrapper: ``ops`` with ``handle`` (an operation in flight and its counters),
``policy`` (every per-backend choice of formulation), ``tensor_meta`` (shapes
sent ahead of tensors) and ``timing`` (collectives timed from outside). Then,
by job: ``checks`` (NCCL's rules, the ledger, hang diagnosis), ``allreduce``
(our algorithms and the dp gradient reduction) and ``compression``.
"""
