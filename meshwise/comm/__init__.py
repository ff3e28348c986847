"""Communication: ``ops`` is the only caller of ``torch.distributed``; the rest builds on it.

Beside it: ``handle``, ``policy`` (per-backend formulations), ``tensor_meta``,
``timing``; by job: ``checks``, ``allreduce``, ``compression`` (docs/architecture.md).
"""
