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
from meshwise.train.evaluation import call_model, evaluate
from meshwise.train.grad_sync import GradSync3D
from meshwise.train.memory import PeakMemory
from meshwise.train.non_finite import NonFiniteError, handle_non_finite, weights_finite
from meshwise.train.routing import RouterBalance
from meshwise.train.run_records import end_notes, step_record, step_values
from meshwise.train.run_state import RunState
from meshwise.train.sampling import end_sample

log = logging.getLogger("meshwise")


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
        self.checkpointer = self._build_checkpointer(named_params)
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

    def _build_checkpointer(self, named_params) -> RunCheckpointer:
        """Saves and loads this rank's pieces of the run (its engine's state, the compressor's)."""
        return RunCheckpointer(
            self.cfg,
            self.run,
            self.mesh,
            self.engine,
            self.parallel_model.pieces(named_params),
            represented=self.grad_sync.represented,
            model=self.model_shape,
            compressor=self.compressor,
            device=self.device,
        )

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
            end_notes(self, val_loss, sample)
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

        sq_norm, skip = self._optimizer_step(step, lr, loss_part, router_table)

        values = step_values(
            self, loss_part, sq_norm, skip, counters.bytes_sent["grad"] - grad_bytes_before
        )
        if router_table is not None:
            self.balance.add_values(values, router_table)
        combined = values.gather(self.mesh.world_group)  # the step's one host read: waits for it
        step_time_s = time.perf_counter() - start
        loss, grad_norm = combined["loss"], math.sqrt(combined["sq_norm"])
        if combined["skip"]:
            self.engine.unstep()
            handle_non_finite(self, step, loss, grad_norm)
        else:
            self.skipped_in_a_row = 0
        record = step_record(self, step, lr, labelled, combined, step_time_s)
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

    def _optimizer_step(self, step: int, lr: float, loss_part, router_table):
        """The global norm, clipping and the optimizer step (skipped where a value is not
        finite); returns the squared norm and the skip flag, both on the device."""
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
        return sq_norm, skip

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
                    out = call_model(self.model, inputs, contexts[i])
                    loss = self.parallel_model.loss(out, targets) * scale
                with ranges.named("backward"):
                    extra = self.balance.extra_loss(contexts[i]) if self.balance else 0.0
                    strict.backward(loss + extra)
            total += loss.detach()
        return total

    def params_finite(self) -> bool:
        """Whether every parameter on every rank is finite (a collective)."""
        return weights_finite(self.engine, self.device, self.mesh.world_group)

    def evaluate(self) -> float | None:
        """Mean labelled-token loss over ``eval_batches`` held-out global batches (None
        when they hold no labelled token)."""
        return evaluate(self)
