"""Ring attention over the cp group (Liu et al. 2023) on zigzag chunks (Megatron-LM's and
Llama 3's load balancing): every step after the first is half a block, blocks no query
sees are skipped (decided on the host), and the backward sends dK/dV around, one
``ops.batch_p2p`` per exchange. See docs/long-sequences.md.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from meshwise.comm import ops
from meshwise.context_parallel import blocks
from meshwise.geometry.documents import shares_a_document
from meshwise.geometry.sequence import zigzag_positions
from meshwise.models.attention import check_heads
from meshwise.models.attention_masks import keys_seen
from meshwise.models.context import WHOLE, ForwardContext
from meshwise.models.dropout import attention_elements, keep_mask

CATEGORY = "cp"


class GroupRing:
    """The ring of a cp group: rank ``r`` sends to ``r + 1`` and receives from ``r - 1``."""

    def __init__(self, group: ops.Group):
        self.group, self.rank, self.size = group, group.rank, group.size

    def exchange(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Send ``tensors`` on; return what the previous rank sent (same shapes)."""
        nxt, prev = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        received = [torch.empty_like(t) for t in tensors]
        ops.batch_p2p(
            [(t, nxt, i) for i, t in enumerate(tensors)],
            [(t, prev, i) for i, t in enumerate(received)],
            self.group,
            category=CATEGORY,
        )
        return received


def _block(step: int, src: int, rank: int, length: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of this step's block."""
    # Zigzag chunks make every step after the first half a block on every rank. Step 0,
    # its own chunks: causal over all its queries (its positions increase). Keys from an
    # earlier rank (src < rank): every query sees their first chunk (src), and their
    # second (2N - 1 - src) lies after both. Keys from a later rank: only the second query
    # chunk (2N - 1 - rank) sees them, both chunks whole.
    half = length // 2
    if step == 0:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


class RingBlocks:
    """Each ring step's block: (query rows, key columns, causal, mask), or None for a
    block no query sees anything of. ``documents`` (of this forward's whole sequences,
    on the device) and ``on_host`` (their ids as a host array): document masking;
    ``window``: a sliding window over global positions (0: none); neither: plain
    causal attention. ``device``: where the masks are made without documents."""

    def __init__(
        self,
        rank: int,
        size: int,
        length: int,
        documents=None,
        on_host=None,
        window: int = 0,
        device=None,
    ):
        self.rank, self.size, self.length = rank, size, length
        self.documents, self.on_host, self.window = documents, on_host, window
        self.device = documents.ids.device if documents is not None else device

    def __call__(self, step: int, src: int):
        rows, cols, causal = _block(step, src, self.rank, self.length)
        if self.documents is None and not self.window:
            return rows, cols, causal, None
        if step and not self._may_see(src):
            return None  # every key of the block lies outside its queries' documents or windows
        q_pos = zigzag_positions(self.length, self.rank, self.size, self.device)[rows]
        k_pos = zigzag_positions(self.length, src, self.size, self.device)[cols]
        return (
            rows,
            cols,
            causal,
            keys_seen(q_pos, k_pos, self.window, self.documents),
        )  # (B or 1, 1, Lq, Lk)

    def _may_see(self, src: int) -> bool:
        """Whether any query of a block after step 0 sees any of its keys, decided from
        the block's edge (its keys all lie before its queries) on the host."""
        last_key, first_query = self._edge(src)
        if self.window and first_query - last_key >= self.window:
            return False
        return self.documents is None or shares_a_document(self.on_host, last_key, first_query)

    def _edge(self, src: int) -> tuple[int, int]:
        """(last key, first query) of a block after step 0, in global positions: its keys
        all lie before its queries (see ``_block``)."""
        chunk = self.length // 2
        if src < self.rank:
            return (src + 1) * chunk - 1, self.rank * chunk
        return (2 * self.size - src) * chunk - 1, (2 * self.size - 1 - self.rank) * chunk


def ring_forward(q, k, v, ring, scale: float, keep_for=None, blocks_of=None):
    """``(out, lse)`` of this rank's queries over the whole sequence.

    ``keep_for(src, rows, cols)``: the dropout keep-mask function of a block
    (``blocks`` takes ``keep(start, end)`` over its key columns), or None.
    ``blocks_of``: a ``RingBlocks`` (default: plain causal attention)."""
    acc = blocks.accumulation_dtype(q.dtype)
    blocks_of = blocks_of or RingBlocks(ring.rank, ring.size, q.shape[2])
    kv = torch.stack([k, v])  # (2, B, G, L, d): one message per step
    out: torch.Tensor  # both set at step 0, from this rank's own block
    lse: torch.Tensor
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        block = blocks_of(step, src)
        if block is not None:
            rows, cols, causal, mask = block
            keep = keep_for(src, rows, cols) if keep_for else None
            o, o_lse = blocks.block_forward(
                q[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], causal, scale, keep, mask
            )
        if step == 0:  # its own block: every query sees its first key there
            # copies that the merges below may change: the kernel's own outputs are
            # what selective checkpointing keeps, to hand back unchanged in the recompute
            out, lse = o.to(acc, copy=True), o_lse.clone()
        elif block is not None:
            blocks.merge(out[:, :, rows], lse[:, :, rows], o.to(acc), o_lse, o_lse)
        if step < ring.size - 1:
            (kv,) = ring.exchange([kv])
    return out.to(q.dtype), lse


def ring_backward(dout, q, k, v, out, lse, ring, scale: float, keep_for=None, blocks_of=None):
    """``(dq, dk, dv)``: dq of this rank's queries, dk/dv of its keys and values."""
    blocks_of = blocks_of or RingBlocks(ring.rank, ring.size, q.shape[2])
    kv = torch.stack([k, v])  # (2, B, G, L, d)
    dq: torch.Tensor  # both set at step 0, from this rank's own block
    dkv: torch.Tensor  # the gradient of the keys held now, travelling with them
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        block = blocks_of(step, src)
        if block is not None:
            rows, cols, causal, mask = block
            keep = keep_for(src, rows, cols) if keep_for else None
            dq_b, dk_b, dv_b = blocks.block_backward(
                dout[:, :, rows],
                q[:, :, rows],
                kv[0][:, :, cols],
                kv[1][:, :, cols],
                out[:, :, rows],
                lse[:, :, rows],
                causal,
                scale,
                keep,
                mask,
            )
        if step == 0:  # its own block covers every query, key and value
            dq, dkv = dq_b, torch.stack([dk_b, dv_b])  # (2, B, G, L, d)
        elif block is not None:
            dq[:, :, rows] += dq_b
            dkv[0][:, :, cols] += dk_b
            dkv[1][:, :, cols] += dv_b
        if step < ring.size - 1:
            kv, dkv = ring.exchange([kv, dkv])
        elif ring.size > 1:  # the gradient of our own keys comes home
            (dkv,) = ring.exchange([dkv])
    return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, keep_for, blocks_of):
        out, lse = ring_forward(q, k, v, ring, scale, keep_for, blocks_of)
        ctx.ring, ctx.scale, ctx.keep_for, ctx.blocks_of = ring, scale, keep_for, blocks_of
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(
            dout, q, k, v, out, lse, ctx.ring, ctx.scale, ctx.keep_for, ctx.blocks_of
        )
        return dq, dk, dv, None, None, None, None


class RingAttention(nn.Module):
    """``ScaledDotProductAttention`` over the cp group (a plan's ``ring_attention`` style): this
    rank's zigzag queries over every rank's keys; dropout masks and documents as one process.
    """

    def __init__(self, cp_group: ops.Group, p: float = 0.0, site: str = ""):
        super().__init__()
        self.cp_group, self.p, self.site = cp_group, p, site

    @classmethod
    def from_sdpa(cls, module, cp_group: ops.Group) -> "RingAttention":
        return cls(cp_group, module.p, module.site)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        causal: bool = True,
        window: int = 0,
        context: ForwardContext | None = None,
    ) -> torch.Tensor:
        """``q``: (B, H, L, d); ``k``, ``v``: (B, G, L, d); L this rank's tokens.
        ``window``: a sliding window over the whole sequence's positions (0: none);
        ``context``: the forward's (its samples, heads and documents)."""
        if not causal:
            raise ValueError(
                "ring attention runs over whole causal sequences; decoding with a "
                "KV cache runs on one process (cp 1)"
            )
        check_heads(q.shape[1], k.shape[1])
        context = context or WHOLE
        keep_for = self._keep_for(q, context) if self.training and self.p else None
        scale = 1.0 / math.sqrt(q.shape[-1])
        if window >= q.shape[2] * self.cp_group.size:
            window = 0  # it covers every key: plain causal attention
        documents = context.documents
        blocks_of = RingBlocks(
            self.cp_group.rank,
            self.cp_group.size,
            q.shape[2],
            None if documents is None else documents.documents,
            None if documents is None else documents.host_ids,
            window=window,
            device=q.device,
        )
        return _RingAttention.apply(q, k, v, GroupRing(self.cp_group), scale, keep_for, blocks_of)

    def _keep_for(self, q: torch.Tensor, context: ForwardContext):
        """The keep-mask of a block: its weights' global (query, key) positions. The
        backward draws the masks again (as FlashAttention replays its generator)
        from the same context: this forward's samples, wherever training has moved on."""
        B, H, length, _ = q.shape
        size, seq_len = self.cp_group.size, q.shape[2] * self.cp_group.size
        mine = zigzag_positions(length, self.cp_group.rank, size, q.device)

        def keep_for(src: int, rows: slice, cols: slice):
            q_pos = mine[rows]
            k_pos = zigzag_positions(length, src, size, q.device)[cols]

            def keep(start: int, end: int) -> torch.Tensor:
                elements = attention_elements(q_pos, k_pos[start:end], seq_len)
                shape = torch.Size([B, H, len(q_pos), end - start])
                return keep_mask(
                    context, self.site, shape, self.p, q.device, per_head=True, elements=elements
                )

            return keep

        return keep_for

    def extra_repr(self) -> str:
        return f"cp_size={self.cp_group.size}" + (
            f", p={self.p}, site={self.site}" if self.p else ""
        )
