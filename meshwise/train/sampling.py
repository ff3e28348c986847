"""A sample at the end of training: a held-out prompt continued by the model.

Every rank runs the same forwards (each its share of the layout) and samples the
same tokens: the last pipeline stage draws each one and tells the others.
"""

from __future__ import annotations

import torch

from meshwise.comm import ops
from meshwise.data.tokenizer import decode_sample


@torch.no_grad()
def end_sample(trainer, num_tokens: int, prompt_len: int = 32,
               temperature: float = 0.8) -> tuple[str, str]:
    """Continue a held-out prompt; every rank samples the same tokens.

    Returns the prompt and the continuation, decoded."""
    trainer.model.eval()
    # Under document masking only the prompt's last document: what its last token sees.
    prompt = trainer.batches.sample_prompt(trainer.cfg.data.seed, prompt_len)
    prompt_len = len(prompt)
    tokens = prompt.to(trainer.device).unsqueeze(0)  # (1, T)
    gen = torch.Generator().manual_seed(trainer.cfg.data.seed)
    for _ in range(num_tokens):
        window = tokens[:, -trainer.cfg.data.seq_len:]
        held, length = trainer.sequence.padded_mine(window)  # a length cp and sp split
        last = trainer.sequence.last_logits(trainer._forward(held), window.shape[1], length,
                                            trainer.model_cfg.vocab_size, trainer.device)
        nxt = torch.zeros(1, dtype=torch.long, device=trainer.device)
        if last is not None:
            probs = torch.softmax(last.float().cpu() / temperature, -1)  # (V,)
            nxt.copy_(torch.multinomial(probs, 1, generator=gen))
        if trainer.pipeline is not None:  # the last stage tells the others
            owner = trainer.pipeline.schedule.owner(trainer.pipeline.num_logical - 1)[0]
            ops.broadcast(nxt, owner, trainer.mesh.pp, category="sample")
        tokens = torch.cat([tokens, nxt.view(1, 1)], dim=1)
    trainer.model.train()
    ids = tokens[0].tolist()
    return decode_sample(trainer.cfg.data.tokenizer, ids[:prompt_len], ids[prompt_len:],
                         trainer.pm.vocab_size)
