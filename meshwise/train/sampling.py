"""A sample at the end of training: a held-out prompt continued by the model.

Every rank runs the same forwards and the last stage tells the others each token. A
window the layout cannot split is padded after its end: under the causal mask the real
tokens' logits are unchanged.
"""

from __future__ import annotations

import torch

from meshwise.comm import ops
from meshwise.data.tokenizer import decode_sample
from meshwise.geometry.sequence import position_owner
from meshwise.train.evaluation import forward_only


@torch.no_grad()
def end_sample(
    trainer, num_tokens: int, prompt_len: int = 32, temperature: float = 0.8
) -> tuple[str, str]:
    """Continue a held-out prompt; every rank samples the same tokens.

    Returns the prompt and the continuation, decoded."""
    trainer.model.eval()
    # Under document masking only the prompt's last document: what its last token sees.
    prompt = trainer.batches.sample_prompt(trainer.cfg.data.seed, prompt_len)
    prompt_len = len(prompt)
    tokens = prompt.to(trainer.device).unsqueeze(0)  # (1, T)
    gen = torch.Generator().manual_seed(trainer.cfg.data.seed)
    shard = trainer.batches.tokens
    for _ in range(num_tokens):
        window = tokens[:, -trainer.cfg.data.seq_len :]
        padded, length = shard.padded(window)  # a length cp and sp split
        # --compile: every length would compile each region anew, and fullgraph fails at
        # dynamo's recompile limit; a few tokens decode eager.
        with torch.compiler.set_stance("force_eager"):
            out = forward_only(trainer, shard.cut(padded))
        last = _last_logits(trainer, out, window.shape[1], length)
        nxt = torch.zeros(1, dtype=torch.long, device=trainer.device)
        if last is not None:
            probs = torch.softmax(last.float().cpu() / temperature, -1)  # (V,)
            nxt.copy_(torch.multinomial(probs, 1, generator=gen))
        if trainer.pipeline is not None:  # the last stage tells the others
            owner = trainer.pipeline.schedule.owner(trainer.pipeline.num_logical - 1)[0]
            ops.broadcast(nxt, owner, trainer.mesh.pp_group, category="sample")
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    trainer.model.train()
    ids = tokens[0].tolist()
    return decode_sample(
        trainer.cfg.data.tokenizer,
        ids[:prompt_len],
        ids[prompt_len:],
        trainer.parallel_model.vocab_size,
    )


def _last_logits(trainer, logits: torch.Tensor | None, n: int, length: int) -> torch.Tensor | None:
    """The logits (V,) at position ``n - 1`` of a padded forward of ``length`` tokens, on
    every rank that holds the model's head (``logits`` not None there): the cp rank
    holding that position hands them to its cp peers."""
    shard = trainer.batches.tokens
    owner, index = position_owner(n - 1, length, shard.cp_size)
    if shard.cp_size == 1:
        return None if logits is None else logits[0, index]
    row = torch.zeros(trainer.model_cfg.vocab_size, dtype=torch.float32, device=trainer.device)
    if logits is not None and shard.cp_rank == owner:
        row.copy_(logits[0, index])
    ops.broadcast(row, owner, trainer.mesh.cp_group, category="sample")
    return None if logits is None else row
