"""Which kernel computes an attention call (``choose_kernel``: from causality, window,
documents, dropout, device and dtype; none forms a (T, T) matrix on CUDA, docs/gpus.md),
and the kernels themselves; ``kernel=`` forces one, so CUDA's are tested on the CPU.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from meshwise.geometry.documents import additive_mask
from meshwise.models import tiled_attention as tiled
from meshwise.models.attention_masks import DocumentMask, keys_seen, window_block_mask

KERNELS = ("sdpa", "sdpa_expanded", "sdpa_mask", "flex", "each_document", "explicit", "tiled")


# call                               CUDA                         CPU (and others)
# dense, bf16 / fp16                 sdpa (flash, cuDNN)          sdpa
# dense, fp32, grouped heads         sdpa_expanded (mem.-eff.)    sdpa
# dense, fp32, one key head per head sdpa (memory-efficient)      sdpa
# sliding window, whole sequences    flex                         sdpa_mask
# sliding window, decoding (cache)   sdpa_mask ((Tq, P+Tq))       sdpa_mask
# documents (and a window)           flex                         each_document
# attention dropout (any mask)       tiled                        explicit
# On CUDA no path forms a (T, T) score matrix; on the CPU the exact paths stay what the
# parity tests hold them to.
def choose_kernel(
    device_type: str,
    dtype: torch.dtype,
    grouped: bool,
    window: bool,
    documents: bool,
    dropout: bool,
    whole: bool,
) -> str:
    """The kernel of a call (the table above). ``window``: a window that hides some
    keys; ``whole``: causal queries over their own keys (no KV cache)."""
    cuda = device_type == "cuda"
    if dropout:
        return "tiled" if cuda else "explicit"
    if documents:
        return "flex" if cuda else "each_document"
    if window:
        return "flex" if cuda and whole else "sdpa_mask"
    if cuda and grouped and dtype == torch.float32:
        return "sdpa_expanded"
    return "sdpa"


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = True,
    window: int = 0,
    documents: DocumentMask | None = None,
    keep=None,
    kernel: str | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v: (B, H, Tq, d) from q (B, H, Tq, d) and k, v
    (B, G, Tk, d), G dividing H.

    ``causal``: query i sees keys up to i (Tq == Tk); else every key, the queries being the
    last Tq positions (after a KV cache). ``window``: 0 for none. ``documents``: attention
    inside each document. ``keep(start, end)``: the dropout keep-mask (B, H, Tq, end - start),
    scaled by 1/(1-p), or None. ``kernel``: one of ``KERNELS`` in place of the choice.
    """
    t_q, t_k = q.shape[2], k.shape[2]
    whole = causal and t_q == t_k
    if causal and not whole:
        raise ValueError(
            f"causal attention of {t_q} queries over {t_k} keys; valid: as "
            "many keys as queries, or causal=False after a KV cache"
        )
    if documents is not None and not whole:
        raise ValueError("document masking runs over whole sequences, not after a KV cache")
    window = window if window and t_k > window else 0  # one covering every key hides none
    grouped = k.shape[1] != q.shape[1]
    kernel = kernel or choose_kernel(
        q.device.type,
        q.dtype,
        grouped,
        bool(window),
        documents is not None,
        keep is not None,
        whole,
    )
    if kernel not in KERNELS:
        raise ValueError(f"attention kernel {kernel!r}; valid: {', '.join(KERNELS)}")
    return _RUN[kernel](q, k, v, causal, window, documents, keep)  # (B, H, Tq, d)


def _sdpa(q, k, v, causal, window, documents, keep):
    return F.scaled_dot_product_attention(
        q, k, v, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


def expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """(B, G, T, d) key/value heads repeated for their ``heads / G`` query heads each:
    (B, heads, T, d), head i holding head i // (heads / G)."""
    B, G, T, d = x.shape
    return x[:, :, None].expand(B, G, heads // G, T, d).reshape(B, heads, T, d)


def _sdpa_expanded(q, k, v, causal, window, documents, keep):
    # SDPA's fused kernels refuse fp32 with grouped heads (flash and cuDNN take no
    # fp32, the memory-efficient kernel no grouped heads), and the math backend
    # forms (B, H, T, T) scores: with the heads expanded the memory-efficient kernel
    # serves it, for (H - G) / G more key/value memory than grouped heads take.
    heads = q.shape[1]
    return F.scaled_dot_product_attention(
        q, expand_heads(k, heads), expand_heads(v, heads), is_causal=causal
    )


def _seen(q, k, window, documents, start: int = 0, end: int | None = None):
    """(B or 1, 1, Tq, end - start) bool: which keys ``start .. end`` each query sees,
    the queries being the last positions."""
    t_q, t_k = q.shape[2], k.shape[2]
    positions = torch.arange(t_k, device=q.device)
    queries, keys = positions[t_k - t_q :], positions[start:end]
    if documents is None:
        return keys_seen(queries, keys, window)
    return documents.seen(queries, keys, window)


def _sdpa_mask(q, k, v, causal, window, documents, keep):
    # A boolean (Tq, Tk) mask: the CPU's exact path for a window, and on any device
    # decoding after a KV cache, where Tq is the few new tokens.
    if not causal and not window:
        return _sdpa(q, k, v, causal, window, documents, keep)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=_seen(q, k, window, documents), enable_gqa=k.shape[1] != q.shape[1]
    )


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Compiled once for the process (as torchtitan does): eager flex_attention forms
    # the whole score matrix; compiled, it runs a fused kernel over the listed blocks.
    return torch.compile(flex_attention)


def _flex(q, k, v, causal, window, documents, keep):
    length = q.shape[2]
    if documents is not None:  # made once per forward, for every layer
        block_mask = documents.block_mask(length, window)
    else:  # made once per shape
        block_mask = window_block_mask(length, window, q.device)
    if q.device.type == "cuda":
        run = _compiled_flex()
    else:  # eager, for the CPU's tests: the same rule, evaluated on every pair
        from torch.nn.attention.flex_attention import flex_attention as run
    return run(q, k, v, block_mask=block_mask, enable_gqa=k.shape[1] != q.shape[1])


def documents_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: list[list[int]], window: int = 0
) -> torch.Tensor:
    """Causal attention inside each document, each on its own (what flash attention's varlen
    kernels do in one launch): no work across documents, no (T, T) mask. ``lengths``: each
    row's document lengths (host integers, summing to T); q (B, H, T, d), k, v (B, G, T, d);
    ``window``: a sliding window inside each document (0: none).
    """
    grouped = k.shape[1] != q.shape[1]
    rows = []
    for b, row in enumerate(lengths):
        parts = zip(q[b].split(row, dim=1), k[b].split(row, dim=1), v[b].split(row, dim=1))
        rows.append(
            torch.cat(
                [
                    _one_document(qd[None], kd[None], vd[None], window, grouped)[0]
                    for qd, kd, vd in parts
                ],
                dim=1,
            )
        )  # (H, T, d)
    return torch.stack(rows)  # (B, H, T, d)


def _one_document(q, k, v, window: int, grouped: bool) -> torch.Tensor:
    length = q.shape[2]
    if not window or length <= window:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)
    positions = torch.arange(length, device=q.device)
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=keys_seen(positions, positions, window), enable_gqa=grouped
    )


def _each_document(q, k, v, causal, window, documents, keep):
    if documents.lengths is None:  # no host lengths to split by: one masked call
        return _sdpa_mask(q, k, v, causal, window, documents, keep)
    return documents_attention(q, k, v, documents.lengths, window)


def explicit_attention(q, k, v, causal: bool, keep, mask=None) -> torch.Tensor:
    """The weights formed explicitly, dropped (``keep(0, Tk)``), then applied.
    ``mask``: an additive (B or 1, 1, Tq, Tk) mask in place of the causal one."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # (B, H, Tk, d)
    v = v.repeat_interleave(group, dim=1)
    t_q, t_k = q.shape[2], k.shape[2]
    att = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, H, Tq, Tk)
    if mask is not None:
        att = att + mask
    elif causal:
        mask = torch.ones(t_q, t_k, dtype=torch.bool, device=q.device).tril()
        att = att.masked_fill(~mask, float("-inf"))
    att = torch.softmax(att, dim=-1)
    if keep is not None:
        att = att * keep(0, t_k).to(att.dtype)
    return att @ v  # (B, H, Tq, d)


def _explicit(q, k, v, causal, window, documents, keep):
    mask = None
    if documents is not None:  # made once per forward, for every layer
        mask = documents.additive(q.shape[2], window, q.dtype)
    elif window:
        mask = additive_mask(_seen(q, k, window, None), q.dtype)
    return explicit_attention(q, k, v, causal, keep, mask)


def _tiled(q, k, v, causal, window, documents, keep):
    allowed = None
    if window or documents is not None:

        def allowed(start: int, end: int) -> torch.Tensor:
            return _seen(q, k, window, documents, start, end)

    return tiled.tiled_attention(
        q, k, v, causal, 1.0 / math.sqrt(q.shape[-1]), keep, allowed, tiled.KV_TILE
    )


_RUN = {
    "sdpa": _sdpa,
    "sdpa_expanded": _sdpa_expanded,
    "sdpa_mask": _sdpa_mask,
    "flex": _flex,
    "each_document": _each_document,
    "explicit": _explicit,
    "tiled": _tiled,
}
