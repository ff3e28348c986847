"""The training loop: builds everything from a ``TrainConfig`` and runs it.

One optimizer step, top to bottom (``train_step``):
  1. the learning rate for this step;
  2. global batch ``step`` (the same on every rank), this dp rank's contiguous
     slice of it, cut into ``grad_accum`` micro-batches;
  3. forward and backward of each micro-batch, its summed token loss divided by
     the tokens of the GLOBAL batch, so gradients are those of the global mean
     whatever the split (DESIGN section 1); gradient sync only on the last one;
  4. the global gradient norm, the clipping coefficient, the optimizer step;
  5. metrics reduced over every rank, written by rank 0.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time

import torch

from meshwise.comm import ops
from meshwise.data import TokenDataset, rank_slice
from meshwise.mesh import Mesh
from meshwise.models.gpt import GPT, GPTConfig
from meshwise.optim import AdamWConfig, lr_at
from meshwise.train.config import TrainConfig
from meshwise.train.metrics import MetricsLog, peak_rss_bytes
from meshwise.zero.optimizer import ZeroOptimizer
from meshwise.zero.params import ZeroStage3

log = logging.getLogger("meshwise")


class NonFiniteError(RuntimeError):
    pass


class Trainer:
    """Trains the GPT of ``cfg`` on this rank's share of the work.

    Call inside an initialised process group (``meshwise.launch`` does that).
    """

    def __init__(self, cfg: TrainConfig, data_path):
        self.cfg = cfg
        self.mesh = Mesh.build(cfg.parallel.dims)
        self.device = torch.device(_rank_device(cfg.runtime.device))
        d = cfg.data
        self.data = TokenDataset(data_path, d.seq_len)
        m = cfg.model.resolved()
        self.model_cfg = GPTConfig(n_layer=m.n_layer, n_head=m.n_head, d_model=m.d_model,
                                   block_size=m.block_size, vocab_size=self.data.vocab_size)
        self.model = GPT(self.model_cfg, seed=d.seed).to(self.device)
        o = cfg.optim
        self.adamw = AdamWConfig(lr=o.lr, betas=(o.beta1, o.beta2), weight_decay=o.weight_decay)
        self.num_params = sum(p.numel() for p in self.model.parameters())
        self.engine = build_engine(self.model, list(self.model.named_parameters()),
                                   self.mesh, cfg, self.adamw)
        self.global_tokens = d.batch_size * d.seq_len
        self.is_logging_rank = self.mesh.rank == 0
        self.metrics = MetricsLog(cfg.runtime.metrics if self.is_logging_rank else None,
                                  o.steps, cfg.runtime.log_every)
        self._fail_at = _injected_failure()

    # ------------------------------------------------------------------ loop
    def train(self) -> dict:
        if self.is_logging_rank:
            n_params = self.num_params
            log.info("model: %s, %.2fM parameters; layout %s; %d tokens per step",
                     self.model_cfg, n_params / 1e6, self.cfg.parallel.dims, self.global_tokens)
        val_loss = None
        for step in range(1, self.cfg.optim.steps + 1):
            record = self.train_step(step)
            if self.cfg.data.eval_every and step % self.cfg.data.eval_every == 0:
                val_loss = record["val_loss"] = self.evaluate()
            if self.is_logging_rank:
                self.metrics.write(record)
        if val_loss is None or self.cfg.optim.steps % (self.cfg.data.eval_every or 1):
            val_loss = self.evaluate()
        summary = {"final_loss": record["loss"], "val_loss": val_loss}
        if self.cfg.data.sample_tokens:
            summary["sample"] = self.sample(self.cfg.data.sample_tokens)
        if self.is_logging_rank:
            self.metrics.note(self.metrics.summary(val_loss))
            if "sample" in summary:
                self.metrics.note("sample:\n" + summary["sample"])
        self.metrics.close()
        return summary

    def train_step(self, step: int) -> dict:
        start = time.perf_counter()
        counters = self.mesh.world.counters
        grad_bytes_before = counters.bytes_sent["grad"]
        lr = lr_at(step, self.cfg.optim.lr, self.cfg.optim.warmup_steps, self.cfg.optim.steps)
        if self._fail_at == (self.mesh.rank, step):
            raise RuntimeError(f"injected failure on rank {self.mesh.rank} at step {step}")

        self.engine.zero_grad()
        loss_part = self._forward_backward(self._micro_batches(step, "train"))
        self.engine.finish_grad_sync()

        grad_norm = self._global_grad_norm()
        clip = self.cfg.optim.clip
        grad_scale = min(1.0, clip / (grad_norm + 1e-6)) if clip > 0 else 1.0
        sums = self._reduce([loss_part, counters.bytes_sent["grad"] - grad_bytes_before],
                            op="sum")
        loss = sums[0]
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            self._handle_non_finite(step, loss, grad_norm)
        else:
            self.engine.step(lr, grad_scale)
        step_time_s = time.perf_counter() - start
        state_bytes, rss = self._reduce([self.engine.state_bytes(), peak_rss_bytes()], op="max")
        return {
            "step": step, "loss": loss, "grad_norm": grad_norm, "lr": lr,
            "tokens": self.global_tokens, "step_time_s": step_time_s,
            "tokens_per_s": self.global_tokens / step_time_s,
            "grad_sync_bytes": int(sums[1]), "model_state_bytes": int(state_bytes),
            "peak_rss_bytes": int(rss),
        }

    # ------------------------------------------------------------- helpers
    def _micro_batches(self, step: int, split: str, num: int | None = None):
        """This dp rank's contiguous slice of global batch ``step``, cut into micro-batches."""
        d = self.cfg.data
        batch = self.data.global_batch(step, d.batch_size, d.seed, split)  # (B, T+1)
        local = rank_slice(batch, self.mesh.dp_rank, self.mesh.dims.dp).to(self.device)
        num = num or d.grad_accum
        return [(mb[:, :-1], mb[:, 1:]) for mb in local.chunk(num)]

    def _forward_backward(self, micro_batches) -> float:
        """Run every micro-batch; return this rank's share of the global mean loss."""
        total = 0.0
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == last else self.engine.no_sync()
            with sync, self._autocast():
                loss = self.model(inputs, targets) / self.global_tokens
                loss.backward()
            total += loss.item()
        return total

    def _autocast(self):
        if self.cfg.runtime.dtype == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _global_grad_norm(self) -> float:
        sq = self.engine.grad_sq_norm().to(torch.float64).reshape(1)
        ops.all_reduce(sq, self.mesh.pp, category="norm")
        return math.sqrt(sq.item())

    def _reduce(self, values, op: str) -> list[float]:
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        ops.all_reduce(t, self.mesh.world, op=op, category="metrics")
        return t.tolist()

    def _handle_non_finite(self, step: int, loss: float, grad_norm: float) -> None:
        message = f"non-finite values at step {step}: loss {loss}, grad_norm {grad_norm}"
        if self.cfg.optim.on_nan == "stop":
            raise NonFiniteError(message + " (stopping; --on-nan skip skips such steps)")
        if self.is_logging_rank:
            log.warning("%s; step skipped (--on-nan skip)", message)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean token loss over ``eval_batches`` held-out global batches."""
        self.model.eval()
        total = 0.0
        for i in range(self.cfg.data.eval_batches):
            for inputs, targets in self._micro_batches(i + 1, "val", num=1):
                with self._autocast():
                    total += self.model(inputs, targets).item()
        self.model.train()
        sums = self._reduce([total], op="sum")
        return sums[0] / (self.cfg.data.eval_batches * self.global_tokens)

    @torch.no_grad()
    def sample(self, num_tokens: int, prompt_len: int = 32, temperature: float = 0.8) -> str:
        """Continue a held-out prompt; every rank samples the same tokens."""
        self.model.eval()
        prompt = self.data.global_batch(0, 1, self.cfg.data.seed, "val")[0, :prompt_len]
        tokens = prompt.to(self.device).unsqueeze(0)  # (1, T)
        gen = torch.Generator().manual_seed(self.cfg.data.seed)
        for _ in range(num_tokens):
            context = tokens[:, -self.model_cfg.block_size:]
            logits = self.model(context)[0, -1].float().cpu() / temperature  # (V,)
            nxt = torch.multinomial(torch.softmax(logits, -1), 1, generator=gen)
            tokens = torch.cat([tokens, nxt.to(self.device).view(1, 1)], dim=1)
        self.model.train()
        data = bytes(int(t) % 256 for t in tokens[0].tolist())
        return data.decode("utf-8", errors="replace")


def build_engine(model, named_params, mesh: Mesh, cfg: TrainConfig, adamw: AdamWConfig):
    """The gradient synchroniser + optimizer for ``--zero``: stages 0-2 share flat
    gradient buckets (``ZeroOptimizer``); stage 3 shards the parameters too."""
    if cfg.parallel.zero == 3:
        return ZeroStage3(model, mesh.dp, adamw)
    return ZeroOptimizer(named_params, mesh.dp, stage=cfg.parallel.zero, adamw=adamw,
                         bucket_cap_mb=cfg.comm.bucket_mb)


def _rank_device(device: str) -> str:
    if device == "cuda":
        return f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
    return "cpu"


def _injected_failure():
    """``MESHWISE_FAIL_AT=RANK:STEP`` makes that rank raise at that step (for testing
    that a failing rank ends the whole job)."""
    spec = os.environ.get("MESHWISE_FAIL_AT")
    if not spec:
        return None
    rank, step = spec.split(":")
    return int(rank), int(step)
