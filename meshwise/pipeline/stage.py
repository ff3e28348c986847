"""A pipeline rank's slice of the GPT: one model chunk per virtual stage.

With ``S`` pipeline ranks and ``V`` virtual stages the ``n_layer`` blocks are cut
into ``S * V`` logical stages of equal size; chunk ``v`` of rank ``r`` is logical
stage ``v * S + r`` (Narayanan et al. 2021, section 2.2.2). The token and
position embeddings live on logical stage 0; the final norm, the head (tied to
the token embedding, so the last stage keeps its own copy of it) and the loss
live on the last logical stage.
"""

from __future__ import annotations

from torch import nn

from meshwise.models.gpt import GPT, GPTConfig


def logical_stage(pp_rank: int, chunk: int, num_stages: int) -> int:
    return chunk * num_stages + pp_rank


def layer_range(stage: int, num_logical_stages: int, n_layer: int) -> range:
    """The blocks of a logical stage (layers divide evenly; checked before launch)."""
    per_stage = n_layer // num_logical_stages
    return range(stage * per_stage, (stage + 1) * per_stage)


def build_chunks(cfg: GPTConfig, seed: int, pp_rank: int, num_stages: int,
                 num_virtual_stages: int = 1, tp_group=None, dropout=None) -> list[GPT]:
    """This rank's chunks, in chunk order; each starts from the single-process values."""
    total = num_stages * num_virtual_stages
    chunks = []
    for chunk in range(num_virtual_stages):
        stage = logical_stage(pp_rank, chunk, num_stages)
        chunks.append(GPT(cfg, seed=seed, layers=layer_range(stage, total, cfg.n_layer),
                          has_embedding=stage == 0, has_head=stage == total - 1,
                          tp_group=tp_group, dropout=dropout))
    if chunks[0].has_embedding and chunks[-1].has_head and len(chunks) > 1:
        chunks[-1].wte = chunks[0].wte  # both ends on one rank: one tied parameter
    return chunks


def named_parameters(chunks: list[nn.Module]) -> list[tuple[str, nn.Parameter]]:
    """Parameters of every chunk under their global (single-model) names, each once."""
    seen, out = set(), []
    for chunk in chunks:
        for name, p in chunk.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((chunk.global_name(name), p))
    return out
