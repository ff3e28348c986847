"""``meshwise train`` against PyTorch's own training, not against our other layouts.

Every layout test compares meshwise with meshwise, so a bug all layouts share
(AdamW, the schedule, loss scaling, clipping, gradient averaging) would pass
them. Here the reference is plain PyTorch: ``torch.optim.AdamW``,
``torch.nn.utils.clip_grad_norm_``, ``F.cross_entropy`` and, for two ranks,
``DistributedDataParallel``, with the learning-rate schedule written out below.
Only the model definition (its initial weights) and the batches come from
meshwise, since those are what both sides must share.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from meshwise.data.dataset import TokenDataset, resolve_data
from meshwise.models.gpt import GPT, GPTConfig
from tests.e2e.conftest import read_metrics, run_cli

STEPS, LR, WARMUP, BATCH, SEQ, SEED = 6, 3e-3, 2, 8, 32, 1234
SIZES = dict(n_layer=2, n_head=4, d_model=64)
FLAGS = [
    "--n-layer",
    2,
    "--n-head",
    4,
    "--d-model",
    64,
    "--seq-len",
    SEQ,
    "--batch-size",
    BATCH,
    "--lr",
    LR,
    "--warmup-steps",
    WARMUP,
    "--steps",
    STEPS,
    "--seed",
    SEED,
    "-q",
]


def cosine_lr(step: int) -> float:
    """Linear warmup, then cosine decay to a tenth (step is 1-based)."""
    if step <= WARMUP:
        return LR * step / WARMUP
    progress = (step - WARMUP) / (STEPS - WARMUP)
    return LR * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def torch_training(data_path: str, rank: int = 0, world: int = 1) -> list[tuple[float, float]]:
    """(loss, grad norm) per step from plain PyTorch; DDP when ``world`` > 1."""
    dataset = TokenDataset(data_path, SEQ)
    model = GPT(GPTConfig(block_size=256, vocab_size=256, **SIZES)).init_weights(SEED)
    if world > 1:
        model = torch.nn.parallel.DistributedDataParallel(model)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(
        [
            {"params": [p for _, p in named if p.dim() >= 2], "weight_decay": 0.1},
            {"params": [p for _, p in named if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=LR,
        betas=(0.9, 0.95),
        eps=1e-8,
        foreach=False,
    )
    out = []
    for step in range(1, STEPS + 1):
        batch = dataset.global_batch(step, BATCH, SEED)  # (B, T + 1), the same on every rank
        rows = batch.chunk(world)[rank]
        logits = model(rows[:, :-1])  # (B / world, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), rows[:, 1:].flatten())  # DDP averages
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step)
        opt.step()
        total = loss.detach().clone()
        if world > 1:
            torch.distributed.all_reduce(total)
        out.append((total.item() / world, norm.item()))
    return out


def _meshwise(tmp_path, corpus, *layout):
    metrics = tmp_path / "m.jsonl"
    result = run_cli("train", *FLAGS, "--data", corpus, "--metrics", metrics, *layout, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    data_path = resolve_data(corpus, cache_dir=tmp_path / "cache")  # the file the run used
    return [(r["loss"], r["grad_norm"]) for r in read_metrics(metrics)], str(data_path)


def _assert_close(ours, theirs):
    assert len(ours) == len(theirs) == STEPS
    for step, ((loss, norm), (ref_loss, ref_norm)) in enumerate(zip(ours, theirs), start=1):
        assert loss == pytest.approx(ref_loss, rel=1e-5), (step, loss, ref_loss)
        assert norm == pytest.approx(ref_norm, rel=1e-5), (step, norm, ref_norm)


def test_one_process_matches_a_plain_pytorch_loop(tmp_path, corpus):
    ours, data_path = _meshwise(tmp_path, corpus, "--dp", "1")
    _assert_close(ours, torch_training(data_path))


def _ddp_rank(data_path):
    torch.manual_seed(0)
    return torch_training(data_path, torch.distributed.get_rank(), 2)


@pytest.mark.parametrize("zero", ["0", "1"])  # plain buckets, and the sharded AdamW
def test_two_ranks_match_pytorch_ddp(tmp_path, corpus, dist_pools, zero):
    ours, data_path = _meshwise(tmp_path, corpus, "--dp", "2", "--zero", zero)
    theirs = dist_pools.run(2, _ddp_rank, data_path)
    assert theirs[0] == theirs[1]
    _assert_close(ours, theirs[0])
