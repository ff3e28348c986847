"""The training loop, built from a ``TrainConfig``: per step (``train_step``, top to bottom)
the learning rate, this rank's micro-batches, forward and backward of each (its loss sum
over the GLOBAL batch's labelled tokens, DESIGN section 1), the global norm, clipping and
the optimizer step, then metrics written by rank 0.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Callable

import torch
from torch import nn

from meshwise.apply.lora import frozen_bytes
from meshwise.comm import ops
from meshwise.comm.checks import strict
from meshwise.data.batches import BatchSource
from meshwise.data.dataset import TokenDataset
from meshwise.data.tokenizer import printable
from meshwise.device import ranges
from meshwise.device.choice import rank_device
from meshwise.geometry.init import Init
from meshwise.geometry.plan import ParallelPlan
from meshwise.mesh import Mesh
from meshwise.models.families import ModelFamily
from meshwise.train.assembly import (
    build_observer,
    build_optimizer,
    build_runtime,
    join_job,
    lay_out_model,
    start_run,
)
from meshwise.train.batches import StepBatches
from meshwise.train.build import dtype_resolved
from meshwise.train.checkpointing import RunCheckpointer
from meshwise.train.config import TrainConfig
from meshwise.train.grad_sync import GradSync3D
from meshwise.train.memory import PeakMemory
from meshwise.train.metrics import RankValues
from meshwise.train.routing import RouterBalance
from meshwise.train.run_state import RunState
from meshwise.train.sampling import end_sample

log = logging.getLogger("meshwise")


class NonFiniteError(RuntimeError):
    pass


class Trainer:
    """Trains the model of ``cfg`` on this rank's share of the work, inside an initialised
    process group (``meshwise.launch``).

    ``run``: the launcher's run state (else computed here, from ``resume``). ``before_step`` /
    ``after_loss``: step hooks (``meshwise.train.faults``). ``model``/``plan``/``init_of``: a model
    of one's own in place of ``cfg``'s family (built on the meta device; ``init_of`` None:
    each module's own initialisation), trained as the families are (docs/own-model.md).
    """

    def __init__(
        self,
        cfg: TrainConfig,
        data_path,
        resume: str | None = None,
        *,
        run: RunState | None = None,
        model: Callable[[], nn.Module] | None = None,
        plan: ParallelPlan | None = None,
        init_of: Callable[[str], Init] | None = None,
    ):
        if (model is None) != (plan is None):
            raise ValueError("a model of one's own needs both model= (a factory) and plan=")
        if run is not None and resume is not None:
            raise ValueError(
                f"resume={resume!r} with run=: the run state names the checkpoint "
                "a launch starts from (run.resume); valid: one of the two"
            )
        own = None if model is None or plan is None else ModelFamily.own(model, plan, init_of)
        cfg.validate(own_model=own is not None)  # the layout's rules (check_layout) among them
        self.device = rank_device(cfg.runtime.device)
        self.cfg = cfg = dtype_resolved(cfg, self.device)
        self.run = run or RunState.in_rank(cfg, data_path).starting_from(cfg.optim, resume)
        # Each part is built from the givens (cfg, run, device) and the parts before it
        # (``meshwise.train.assembly``): the order of the calls is their dependencies.
        self.mesh = join_job(cfg, self.run, data_path, self.device)
        self.data, self.batches = self._build_data(self.mesh, data_path)
        self.family, self.model_cfg, self.parallel_model, self.model_shape = lay_out_model(
            cfg, self.mesh, self.data.vocab_size, own
        )
        self.batches.feed(
            self.parallel_model.chunks
        )  # each forward's context, where the model takes it
        named_params = self.parallel_model.named_parameters()  # before the engine owns them
        self.num_params = sum(param.numel() for _, param in named_params)
        self.compressor, self.engine, self.comm_stats = build_optimizer(
            cfg, self.mesh, self.family, self.model_cfg, self.parallel_model, self.device
        )
        self.grad_sync = GradSync3D(named_params, self.mesh, self.engine, self.parallel_model)
        self.frozen_bytes = frozen_bytes(self.parallel_model.chunks)  # held beside the engine
        micro_per_step = cfg.data.grad_accum * cfg.parallel.num_micro_batches
        self.balance = RouterBalance.of(self.model_cfg, self.mesh, cfg.parallel.sp, micro_per_step)
        self.checkpointer = RunCheckpointer(
            cfg,
            self.run,
            self.mesh,
            self.engine,
            self.parallel_model.pieces(named_params),
            represented=self.grad_sync.represented,
            model=self.model_shape,
            compressor=self.compressor,
            device=self.device,
        )
        self.model, self.pipeline = build_runtime(cfg, self.mesh, self.parallel_model, self.engine)
        self.start_step, self.lr_schedule, self.metrics = start_run(
            cfg, self.run, self.checkpointer, self.is_logging_rank
        )
        self.observer = build_observer(
            cfg, self.run, self.mesh, self.device, self.family, self.model_cfg, self.parallel_model
        )
        # Hooks of the step, empty unless installed (``meshwise.train.faults``):
        # ``hook(step)`` before it, ``loss = hook(step, loss)`` on this rank's loss.
        self.before_step: list[Callable[[int], None]] = []
        self.after_loss: list[Callable[[int, torch.Tensor], torch.Tensor]] = []
        self.skipped_in_a_row = 0
        self.memory = PeakMemory(self.device)  # after start-up: it keeps that peak too

    def _build_data(self, mesh: Mesh, data_path):
        """The token file and the step's batches, which give each micro-batch its
        forward's context (samples, this rank's tokens, documents)."""
        d, p = self.cfg.data, self.cfg.parallel
        data = TokenDataset(
            data_path,
            d.seq_len,
            vocab_size=self.cfg.model.vocab_size,
            token_dtype=d.token_dtype,
            data_order=d.data_order,
        )
        batches = StepBatches(
            BatchSource(data, d.document_mask, d.loss_on, d.long_conversations),
            mesh,
            p.sp,
            self.device,
        )
        return data, batches

    @property
    def global_tokens(self) -> int:
        return self.cfg.data.batch_size * self.cfg.data.seq_len

    @property
    def reports_loss(self) -> bool:
        """Whether this rank's loss counts: the last stage (rank 0 in a V), once per tp
        group (every cp rank holds other tokens)."""
        return self.parallel_model.holds_last_stage and self.mesh.tp_rank == 0

    @property
    def is_logging_rank(self) -> bool:
        return self.mesh.rank == 0

    # ------------------------------------------------------------------ loop
    def train(self) -> list[dict]:
        """Run every step; return each step's metrics record (the same on every rank)."""
        d = self.cfg.data
        if self.is_logging_rank:
            log.info(
                "model: %s; %.2fM parameters on rank 0; layout %s; %d tokens per step; "
                "%d CPU threads per rank",
                self.model_cfg or self.model_shape,
                self.num_params / 1e6,
                self.cfg.parallel.dims,
                self.global_tokens,
                torch.get_num_threads(),
            )
        try:  # the loggers keep what was logged, also when a step fails
            records = self._run_steps()
            val_loss = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
            if not self.params_finite():  # never end "successfully" with a broken model
                raise NonFiniteError("the weights are non-finite at the end of training")
            if not (d.eval_every and self.cfg.optim.steps % d.eval_every == 0):
                val_loss = self.evaluate()  # the last step was not evaluated yet
                self.observer.log({"step": self.cfg.optim.steps, "val_loss": val_loss})
            sample = end_sample(self, d.sample_tokens) if d.sample_tokens else None
        finally:
            self.observer.close()
        if self.is_logging_rank:
            self.metrics.note(self.metrics.summary(val_loss))
            self.metrics.note(self.observer.summary())
            if self.batches.source.summary():  # chat data: packing, and what it truncated
                self.metrics.note(f"data: {self.batches.source.summary()}")
            if sample is not None:
                prompt, continuation = sample
                self.metrics.note(
                    f"sample (prompt in [brackets]):\n[{printable(prompt)}]"
                    f"{printable(continuation)}"
                )
        self.metrics.close()
        self.comm_stats.close()
        return records

    def _run_steps(self) -> list[dict]:
        """Every step from where the run starts; their records."""
        d, records = self.cfg.data, []
        for step in range(self.start_step + 1, self.cfg.optim.steps + 1):
            try:
                record = self.train_step(step)
            except ops.CollectiveTimeout as exc:
                raise ops.CollectiveTimeout(f"step {step}: {exc}") from None
            if d.eval_every and step % d.eval_every == 0:
                record["val_loss"] = self.evaluate()
            records.append(record)
            if self.is_logging_rank:
                self.metrics.write(record)
                self.observer.log(record)
            if self.checkpointer.due(step):
                with ranges.named("checkpoint/save"):
                    self.checkpointer.save(step)
        return records

    def train_step(self, step: int) -> dict:
        self.memory.start_step()
        start = time.perf_counter()
        counters = self.mesh.world_group.counters
        grad_bytes_before = counters.bytes_sent["grad"]
        lr = self.lr_schedule.lr(step)
        for hook in self.before_step:
            hook(step)
        self.observer.start_step(step)

        with self.observer.phase("forward_backward"):
            self.engine.zero_grad()
            micro_batches, contexts, labelled = self._micro_batches(step, "train")
            if self.balance is not None:  # each micro-batch's router tally
                contexts = self.balance.attach(contexts)
            loss_part = self._forward_backward(micro_batches, contexts, labelled)
        for loss_hook in self.after_loss:
            loss_part = loss_hook(step, loss_part)
        with self.observer.phase("grad_sync"):
            self.grad_sync.finish()
        router_table = None
        if self.balance is not None:  # the step's tokens per expert
            router_table = self.balance.step_table(self.device)

        # Norm, clipping and the non-finite check stay on the device: the step needs
        # no host read before the optimizer (a skipped step changes nothing there).
        with self.observer.phase("optimizer"):
            sq_norm, skip = self.grad_sync.norm_and_skip(loss_part)
            if router_table is not None:  # the routing biases move with the step, or not
                self.balance.update_biases(router_table, self.engine.checkpoint_runs(), skip)
            clip = self.cfg.optim.clip
            grad_scale = (clip / (sq_norm.sqrt() + 1e-6)).clamp(max=1.0) if clip > 0 else 1.0
            self.engine.step(lr, grad_scale, skip)
        if self.compressor is not None:  # its warm-up and top-k's ramp count steps taken
            self.compressor.end_step()
        every = self.cfg.runtime.check_replicas_every
        replicas = self.mesh.dims.tp > 1 or self.mesh.replicate_group is not None
        if every and step % every == 0 and replicas:
            self.grad_sync.check_replica_values()

        values = self._step_values(
            loss_part, sq_norm, skip, counters.bytes_sent["grad"] - grad_bytes_before
        )
        if router_table is not None:
            self.balance.add_values(values, router_table)
        combined = values.gather(self.mesh.world_group)  # the step's one host read: waits for it
        step_time_s = time.perf_counter() - start
        loss, grad_norm = combined["loss"], math.sqrt(combined["sq_norm"])
        if combined["skip"]:
            self.engine.unstep()
            self._handle_non_finite(step, loss, grad_norm)
        else:
            self.skipped_in_a_row = 0
        record = self._record(step, lr, labelled, combined, step_time_s)
        if router_table is not None:
            record.update(self.balance.report(combined))
        # Every rank issued the same operations on every group, or the ledger names the
        # rank that did not (a desync is wrong before it hangs): every few steps, and
        # always before results are written (the last step, a checkpoint).
        ops.check_ledger(
            self.cfg.comm.timeout_s,
            step,
            now=step == self.cfg.optim.steps or self.checkpointer.due(step),
        )
        return record

    def _record(
        self, step: int, lr: float, labelled: int, combined: dict, step_time_s: float
    ) -> dict:
        """The step's metrics line (docs/flags.md) from the values every rank combined."""
        record = {
            "step": step,
            "loss": combined["loss"] if labelled else None,  # no target, no loss: not 0
            "grad_norm": math.sqrt(combined["sq_norm"]),
            "lr": lr,
            "tokens": self.global_tokens,
            "labelled_tokens": labelled,
            "step_time_s": step_time_s,
            "tokens_per_s": self.global_tokens / step_time_s,
            "grad_sync_bytes": int(combined["grad_sync_bytes"]),
            "model_state_bytes": int(combined["model_state_bytes"]),
            "peak_rss_bytes": int(combined["peak_rss_bytes"]),
            "peak_mem_bytes": int(combined["peak_mem_bytes"]),
        }
        if self.cfg.data.data_order == "epochs":
            record.update(self.batches.source.epoch_position(step, self.cfg.data.batch_size))
        record.update(self.comm_stats.record(combined))
        self.observer.record(record)
        if self.cfg.parallel.zero == 3:
            # Transient: full parameters gathered at once (unit in use + prefetched).
            record["zero3_peak_gathered_bytes"] = int(combined["gathered"])
        return record

    def _step_values(self, loss_part, sq_norm, skip, grad_bytes: float) -> RankValues:
        """What the metrics need from every rank, combined in one collective."""
        values = RankValues(self.device)
        values.add("loss", loss_part if self.reports_loss else 0.0, "sum")
        values.add("sq_norm", sq_norm, "first")
        values.add("skip", skip, "max")
        values.add("grad_sync_bytes", grad_bytes, "sum")
        values.add("model_state_bytes", self.engine.state_bytes() + self.frozen_bytes, "max")
        values.add("peak_rss_bytes", self.memory.run_peak_rss_bytes(), "max")
        values.add("peak_mem_bytes", self.memory.step_peak_bytes(), "max")
        values.add("gathered", getattr(self.engine, "peak_gathered_bytes", 0), "max")  # ZeRO-3
        self.comm_stats.add_to(values)
        return values

    # ------------------------------------------------------------- helpers
    def _micro_batches(self, step: int, split: str, num: int | None = None):
        """This rank's micro-batches of global batch ``step``, their forwards' contexts
        and the batch's labelled tokens."""
        d = self.cfg.data
        num = num or d.grad_accum * self.cfg.parallel.num_micro_batches
        return self.batches.take(step, d.batch_size, d.seed, num, split)

    def _forward_backward(self, micro_batches, contexts, labelled: int) -> torch.Tensor:
        """Run every micro-batch with its context (``contexts``); return this rank's share of the
        global mean loss over ``labelled`` targets (0-dim, on the device). Gradients sync over dp
        only in the last accumulation round.
        """
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        scale = 1.0 / max(labelled, 1)  # a batch without labels: no loss, no gradient
        if self.pipeline is not None:
            rounds = self.cfg.data.grad_accum
            per_round = len(micro_batches) // rounds
            for r in range(rounds):
                part = slice(r * per_round, (r + 1) * per_round)
                total += self.pipeline.run(
                    micro_batches[part], scale, sync=r == rounds - 1, contexts=contexts[part]
                )
            return total
        last = len(micro_batches) - 1
        for i, (inputs, targets) in enumerate(micro_batches):
            sync = contextlib.nullcontext() if i == last else self.engine.no_sync()
            with sync:
                with ranges.named("forward"):
                    out = self._call(inputs, contexts[i])
                    loss = self.parallel_model.loss(out, targets) * scale
                with ranges.named("backward"):
                    extra = self.balance.extra_loss(contexts[i]) if self.balance else 0.0
                    strict.backward(loss + extra)
            total += loss.detach()
        return total

    def _reduce(self, values, op: str) -> list[float]:
        """All-reduce numbers and 0-dim device tensors as one tensor; back on the host."""
        if any(torch.is_tensor(v) for v in values):
            t = torch.stack(
                [torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values]
            )
        else:  # plain numbers: one copy to the device, not one per number
            t = torch.tensor(values, dtype=torch.float64, device=self.device)
        ops.all_reduce(t, self.mesh.world_group, op=op, category="metrics")
        return t.tolist()

    def _handle_non_finite(self, step: int, loss: float, grad_norm: float) -> None:
        """Stop, or skip the step; skipping stops too once it cannot help."""
        message = f"non-finite values at step {step}: loss {loss}, grad_norm {grad_norm}"
        o = self.cfg.optim
        if o.on_nan == "stop":
            raise NonFiniteError(message + " (stopping; --on-nan skip skips such steps)")
        self.skipped_in_a_row += 1
        if not self.params_finite():
            raise NonFiniteError(
                message + "; the weights themselves are non-finite (an "
                "earlier update diverged), so skipping cannot recover"
            )
        if self.skipped_in_a_row > o.max_skipped_steps:
            raise NonFiniteError(
                f"{message}; {self.skipped_in_a_row} steps in a row skipped "
                f"(--max-skipped-steps {o.max_skipped_steps})"
            )
        if self.is_logging_rank:
            log.warning("%s; step skipped (--on-nan skip)", message)

    def params_finite(self) -> bool:
        """Whether every parameter on every rank is finite (a collective)."""
        ok = all(
            bool(torch.isfinite(run.tensors["param"][0]).all())
            for run in self.engine.checkpoint_runs()
        )
        return self._reduce([1.0 if ok else 0.0], op="min")[0] == 1.0

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """Mean labelled-token loss over ``eval_batches`` held-out global batches (None
        when they hold no labelled token)."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        labelled = 0
        for i in range(self.cfg.data.eval_batches):
            [(inputs, targets)], contexts, count = self._micro_batches(i + 1, "val", num=1)
            labelled += count
            loss = self._forward(inputs, targets, contexts[0])
            if loss is not None and self.reports_loss:
                total += loss.detach()
        self.model.train()
        sums = self._reduce([total], op="sum")
        return sums[0] / labelled if labelled else None

    def _forward(self, inputs, targets=None, context=None):
        """Forward only: the loss sum (or full logits) where the last stage is, else None."""
        if self.pipeline is None:
            out = self._call(inputs, context)
        else:
            out = self.pipeline.forward_only(inputs, context=context)
            if out is None:
                return None
        return (
            self.parallel_model.loss(out, targets)
            if targets is not None
            else self.parallel_model.full_logits(out)
        )

    def _call(self, inputs, context):
        """The model on ``inputs``, told its forward's ``context`` where it takes one."""
        return self.model(inputs) if context is None else self.model(inputs, context=context)
