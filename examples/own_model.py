"""Train a model of your own with meshwise, and check it against plain PyTorch.

The model below is not part of meshwise: a small decoder with its own module
names and a tied embedding and output head. ``PLAN`` says how parallelism
applies to it; ``Trainer(cfg, data, model=TinyLM, plan=PLAN)`` trains it on any
layout with everything ``meshwise train`` does (gradient sync on every axis,
ties across pipeline stages, global-norm clipping, ZeRO, schedules, checkpoints,
metrics). Each layout's per-step loss must equal a plain single-process PyTorch
loop's (same initial values, same batches, ``torch.optim.AdamW``,
``clip_grad_norm_``) to 1e-5.

Run: ``python examples/own_model.py`` (dp 2, tp 2, pp 2 and dp 2 ZeRO-3, two CPU
processes each).
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from meshwise import ParallelPlan, TrainConfig, Trainer, launch

VOCAB, WIDTH, HEADS, LAYERS = 257, 64, 4, 2  # 257: bytes and an end-of-text id
LAYOUTS = {"dp2": dict(dp=2), "tp2": dict(tp=2), "pp2": dict(pp=2), "dp2-zero3": dict(dp=2, zero=3)}


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH, bias=False) for _ in range(4))

    def forward(self, x):
        B, T, _ = x.shape
        # -1, not HEADS: under tensor parallelism this rank holds HEADS / tp heads.
        q, k, v = (
            f(x).view(B, T, -1, WIDTH // HEADS).transpose(1, 2)  # (B, nh, T, hs)
            for f in (self.q, self.k, self.v)
        )
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(B, T, -1))  # (B, T, nh * hs)


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2 = nn.Linear(WIDTH, 4 * WIDTH), nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x):
        return self.w2(F.gelu(self.w1(x)))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm1, self.attn = nn.LayerNorm(WIDTH), Attention()
        self.norm2, self.ffn = nn.LayerNorm(WIDTH), FeedForward()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class TinyLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.tok_emb = nn.Embedding(VOCAB, WIDTH)
        self.layers = nn.ModuleDict({str(i): Layer() for i in range(LAYERS)})
        self.final_norm = nn.LayerNorm(WIDTH)
        self.out = nn.Linear(WIDTH, VOCAB, bias=False)
        self.out.weight = self.tok_emb.weight  # tied

    def forward(self, x):  # token ids (B, T) on the first stage, activations after it
        if self.tok_emb is not None:  # a pipeline stage sets the modules it lacks to None
            x = self.tok_emb(x)
        for layer in self.layers.values():
            x = layer(x)
        if self.final_norm is not None:
            # The head shares the N(0, 1) embedding: scaled, its first logits are O(1).
            x = self.out(self.final_norm(x)) * WIDTH**-0.5
        return x  # logits (B, T, VOCAB) on the last stage


PLAN = ParallelPlan(
    layers="layers",
    first_stage=("tok_emb",),
    last_stage=("final_norm", "out"),
    tp=(
        ("layers.*.attn.q", "colwise"),
        ("layers.*.attn.k", "colwise"),
        ("layers.*.attn.v", "colwise"),
        ("layers.*.attn.o", "rowwise"),
        ("layers.*.ffn.w1", "colwise"),
        ("layers.*.ffn.w2", "rowwise"),
        ("tok_emb", "vocab_embedding"),
        ("out", "vocab_head"),
    ),
    ties=(("tok_emb.weight", "out.weight"),),
)


def config(steps: int = 4, dp: int = 1, tp: int = 1, pp: int = 1, zero: int = 0) -> TrainConfig:
    cfg = TrainConfig()
    cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.zero = dp, tp, pp, zero
    cfg.data.seq_len, cfg.data.batch_size, cfg.data.seed, cfg.data.eval_batches = 32, 8, 0, 1
    cfg.optim.steps, cfg.optim.lr, cfg.optim.warmup_steps, cfg.optim.clip = steps, 3e-3, 1, 1.0
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    return cfg


def train(cfg: TrainConfig, data_path: str) -> list[float]:
    """On every rank (inside ``meshwise.launch``): each step's global mean loss."""
    return [r["loss"] for r in Trainer(cfg, data_path, model=TinyLM, plan=PLAN).train()]


def reference(cfg: TrainConfig, data_path: str) -> list[float]:
    """The same training in one process with plain PyTorch."""
    from meshwise import parallelize
    from meshwise.data.dataset import TokenDataset
    from meshwise.train.lr_schedule import lr_at

    # The initial values every layout starts from: each module's own initialisation,
    # drawn from the seed; one process holds every element.
    with torch.device("meta"):
        meta_model = TinyLM()
    values = parallelize(meta_model, PLAN).init_values(seed=cfg.data.seed)
    model = TinyLM()
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(values(name, 0, param.numel()).view(param.shape))
    o, d = cfg.optim, cfg.data
    matrices = [p for p in model.parameters() if p.dim() >= 2]  # weight decay: matrices only
    others = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": matrices, "weight_decay": o.weight_decay},
            {"params": others, "weight_decay": 0.0},
        ],
        lr=o.lr,
        betas=(o.beta1, o.beta2),
    )
    data, losses = TokenDataset(data_path, d.seq_len), []
    for step in range(1, o.steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, o.lr, o.warmup_steps, o.steps)
        batch = data.global_batch(step, d.batch_size, d.seed, "train")  # (B, T + 1)
        logits = model(batch[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), batch[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        if o.clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.clip)
        opt.step()
        losses.append(loss.item())
    return losses


def write_tokens(path: Path) -> str:
    """A token file: this file's bytes, a few times over (ids 0-255)."""
    text = Path(__file__).read_bytes() * 4
    np.frombuffer(text, dtype=np.uint8).astype(np.uint16).tofile(path)
    return str(path)


def check(name: str, cfg: TrainConfig, data_path: str, expected: list[float]) -> None:
    """On every rank: train one layout; rank 0 compares with the reference."""
    losses = train(cfg, data_path)
    worst = max(abs(a - b) for a, b in zip(losses, expected))
    assert worst <= 1e-5, f"{name}: loss {losses} vs plain PyTorch {expected}"
    if torch.distributed.get_rank() == 0:
        print(f"{name}: {len(losses)} steps, largest difference from plain PyTorch {worst:.1e}")


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        data_path = write_tokens(Path(tmp) / "tokens.bin")
        expected = reference(config(), data_path)
        for name, layout in LAYOUTS.items():
            cfg = config(**layout)
            launch.launch(
                check, (name, cfg, data_path, expected), world_size=2, device="cpu", timeout_s=120
            )


if __name__ == "__main__":
    sys.exit(main())
