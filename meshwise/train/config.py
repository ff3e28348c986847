"""Training configuration: nested typed dataclasses of the settings (what the user asked),
validated in one place; what the launcher decides is run state (``run_state``).

``TrainConfig.validate()`` checks everything checkable before any rank starts and raises
``ValueError`` naming the bad value and what would be valid (the CLI exits 2).
"""

from __future__ import annotations

import dataclasses
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from meshwise.apply.activation_checkpointing import MODES as ACTIVATION_CHECKPOINTING
from meshwise.apply.lora import LoraConfig
from meshwise.comm.allreduce.algorithms import ALGORITHMS
from meshwise.comm.compression.compressors import (
    COMPRESS_WARMUP_STEPS,
    TOPK_RAMP_STEPS,
    parse_compress,
)
from meshwise.data.order import DATA_ORDERS
from meshwise.data.packing import LONG_CONVERSATIONS, LOSS_ON
from meshwise.data.readers import DATA_FORMATS
from meshwise.device.choice import DEVICES
from meshwise.geometry.sequence import SequenceShard
from meshwise.mesh import ParallelDims
from meshwise.models.families import family
from meshwise.pipeline.schedules import SCHEDULE_KINDS
from meshwise.train.layout_rules import ZERO_STAGES, check_layout  # noqa: F401 (ZERO_STAGES)
from meshwise.train.loggers import LOG_ERRORS, parse_log_to
from meshwise.train.lr_schedule import check_schedule

# The model section and its presets, part of this module's interface.
from meshwise.train.model_config import (  # noqa: F401
    LLAMA_ONLY,
    MODEL_PRESETS,
    MOE_SETTINGS,
    ModelConfig,
)
from meshwise.train.profiling import parse_steps
from meshwise.train.value_checks import choice, flag_name, non_negative, positive

SCHEDULES = SCHEDULE_KINDS
DTYPES = ("auto", "fp32", "bf16")
GRAD_REDUCE_DTYPES = ("fp32", "bf16")
ON_NAN = ("stop", "skip")
TOKEN_DTYPES = ("uint16", "uint32")
DATA_KINDS = ("text", "chat")
# A collective's timeout: below a second even connecting fails; gloo and NCCL keep it
# in milliseconds, and a year is longer than any step should wait.
TIMEOUT_RANGE_S = (1.0, 365 * 24 * 3600.0)
MAX_VOCAB_SIZE = 1 << 32  # token files hold uint32 ids at most


@dataclass
class ParallelConfig:
    dp: int = 1
    tp: int = 1
    pp: int = 1
    cp: int = 1  # context parallel: every sequence split across cp ranks, ring attention
    sp: bool = False  # sequence parallel: the sequence split across tp between its layers
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 0  # 0: pp when pp > 1, else 1
    zero: int = 0
    reshard_after_forward: bool = False  # ZeRO-3 under a pipeline: gather per micro-batch
    ep: int = 1  # expert parallel: each MoE layer's experts over ep of the dp x cp ranks
    dp_shard: int = 0  # ZeRO over dp_shard dp ranks, replicas across; 0: all of dp

    @property
    def dims(self) -> ParallelDims:
        return ParallelDims(
            dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, ep=self.ep, dp_shard=self.dp_shard
        )

    @property
    def axes_text(self) -> str:
        """The axes whose product is the world, as messages name them."""
        return "dp x cp x tp x pp" if self.cp > 1 else "dp x tp x pp"

    @property
    def sequence_divisor(self) -> int:
        """What every sequence's length must be a multiple of: 2 x cp zigzag chunks, and
        each cp rank's tokens split across tp under sequence parallelism."""
        return SequenceShard(cp_size=self.cp, sp_size=self.tp if self.sp else 1).tokens_divisor

    @property
    def num_micro_batches(self) -> int:
        if self.micro_batches:
            return self.micro_batches
        return self.pp if self.pp > 1 else 1


@dataclass
class OptimConfig:
    steps: int = 200
    lr: float = 1e-3
    warmup_steps: int = 20
    weight_decay: float = 0.1
    clip: float = 1.0
    beta1: float = 0.9
    beta2: float = 0.95
    on_nan: str = "stop"
    max_skipped_steps: int = 3  # with on_nan "skip": stop after more in a row
    lr_schedule: str = "cosine"  # meshwise.train.lr_schedule: cosine, wsd, constant
    decay_steps: int | None = None  # wsd: the decay's steps; None: the last 20%
    decay_shape: str = "linear"  # wsd: linear, sqrt, cosine
    min_lr_ratio: float = 0.1  # where cosine and wsd decay to, as a share of lr
    lr_restart: bool = False  # resuming under another schedule: start it at the step resumed


@dataclass
class DataConfig:
    path: str | None = None
    cache_dir: str | None = None
    tokenizer: str | None = None  # a tokenizer.json; None: byte-level
    token_dtype: str | None = None  # of a .bin without our sidecar; None: the sidecar's
    text_field: str = "text"  # records' text (meshwise.data.readers)
    data_format: str = "auto"
    skip_bad_records: bool = False
    data_order: str = "random-windows"  # meshwise.data.order: random-windows, epochs
    seq_len: int = 128
    batch_size: int = 16
    grad_accum: int = 1
    seed: int = 1234
    eval_every: int = 0
    eval_batches: int = 4
    sample_tokens: int = 0
    # supervised fine-tuning on chat records, and packing (meshwise.data.batches)
    format: str = "text"  # text, or chat: records of messages rendered by a chat template
    chat_template: str | None = None  # None: the tokenizer's own; or a built-in or a file
    loss_on: str = "assistant"  # chat data: the targets in the loss (assistant or all)
    long_conversations: str = "truncate"  # a conversation longer than a row: truncate/refuse
    document_mask: bool = False  # attention and positions inside each document


@dataclass
class CommConfig:
    bucket_mb: float = 25.0
    timeout_s: float = 300.0
    # dp gradient sync (meshwise.comm): compression, algorithm, node grouping
    compress: str = "none"  # none, fp16, bf16, int8, topk:FRACTION, powersgd:RANK
    error_feedback: str = "on"
    compress_warmup_steps: int = COMPRESS_WARMUP_STEPS  # top-k and PowerSGD start after these
    topk_ramp_steps: int = TOPK_RAMP_STEPS  # top-k density falls from 25% to FRACTION over these
    allreduce: str = "native"  # native, ring, tree, hierarchical, adaptive
    ranks_per_node: int = 0  # 0: torchrun's LOCAL_WORLD_SIZE, else all ranks on one node


@dataclass
class RuntimeConfig:
    device: str = "auto"
    dtype: str = "auto"  # the launcher resolves it: bf16 on a CUDA device with bf16, else fp32
    grad_reduce_dtype: str = "fp32"  # with --dtype bf16: the dtype gradients are summed in
    metrics: str | None = None
    log_every: int = 10
    quiet: bool = False
    check_replicas_every: int = 100  # compare tp replicas' values every N steps; 0: never
    activation_checkpointing: str = "none"  # "full": recompute each block in backward
    compile: bool = False  # torch.compile each transformer block (meshwise.apply.compile)
    # watching a run (meshwise.train.observe): loggers, their folder and run, the profiler
    log_to: str = "none"  # comma-separated: tensorboard, wandb, mlflow
    # The three folders and names as given; None: the launcher's choice (``RunState``).
    log_dir: str | None = None
    run_name: str | None = None
    project: str = "meshwise"
    log_errors: str = "warn"  # a logger that fails: "warn" (it goes off) or "fatal"
    profile_steps: str | None = None  # "A-B"
    profile_dir: str | None = None
    peak_tflops: float = 0.0  # one device's peak for MFU; 0: data sheet (GPU) or measured


@dataclass
class CheckpointConfig:
    save: str | None = None  # directory of checkpoints (one subdirectory per save)
    save_every: int | None = None  # None: only at the end
    keep_last: int | None = None  # None: keep every checkpoint
    resume: str | None = None  # a checkpoint, a --save directory, or "auto"
    max_restarts: int = 0
    branch: bool = False  # resuming an older step: set newer checkpoints aside, not refuse


@dataclass
class TrainConfig:
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def ledger_dir(self) -> Path:
        """Where ranks write their collective ledgers when something goes wrong: beside
        the metrics, else in the save directory, else in the system's temporary folder."""
        if self.runtime.metrics:
            metrics = Path(self.runtime.metrics)
            return metrics.with_name(metrics.name + ".ledger")
        if self.checkpoint.save:
            return Path(self.checkpoint.save) / "ledger"
        return Path(tempfile.gettempdir()) / "meshwise-ledger"

    def validate(self, own_model: bool = False) -> "TrainConfig":
        """Raise ``ValueError`` naming the first bad value; return self.

        ``own_model``: the model is the caller's (``Trainer(model=...)``), not the
        ``model`` section's: its sizes are checked by ``parallelize`` instead."""
        m, o, d = self.model, self.optim, self.data
        positive(
            seq_len=d.seq_len,
            batch_size=d.batch_size,
            steps=o.steps,
            bucket_mb=self.comm.bucket_mb,
            timeout_s=self.comm.timeout_s,
            eval_batches=d.eval_batches,
            log_every=self.runtime.log_every,
        )
        non_negative(
            warmup_steps=o.warmup_steps,
            eval_every=d.eval_every,
            sample_tokens=d.sample_tokens,
            clip=o.clip,
            weight_decay=o.weight_decay,
            n_layer=m.n_layer,
            n_head=m.n_head,
            d_model=m.d_model,
            block_size=m.block_size,
        )
        positive(lr=o.lr)
        self.lora.check()
        non_negative(check_replicas_every=self.runtime.check_replicas_every)
        non_negative(seed=d.seed, vocab_size=m.vocab_size, max_skipped_steps=o.max_skipped_steps)
        low, high = TIMEOUT_RANGE_S
        if not low <= self.comm.timeout_s <= high:
            raise ValueError(
                f"--timeout-s {self.comm.timeout_s:g} is out of range; valid: "
                f"{low:g} to {high:.0f} seconds (a year)"
            )
        if m.vocab_size > MAX_VOCAB_SIZE:
            raise ValueError(
                f"--vocab-size {m.vocab_size} is more ids than token files hold; "
                f"valid: up to {MAX_VOCAB_SIZE} (uint32)"
            )
        if d.token_dtype is not None:
            choice("--token-dtype", d.token_dtype, TOKEN_DTYPES)
        choice("--format", d.format, DATA_KINDS)
        choice("--loss-on", d.loss_on, LOSS_ON)
        choice("--long-conversations", d.long_conversations, LONG_CONVERSATIONS)
        for flag, beta in (("--beta1", o.beta1), ("--beta2", o.beta2), ("--dropout", m.dropout)):
            if not 0 <= beta < 1:
                raise ValueError(f"{flag} must be in [0, 1), got {beta}")
        choice("--model", m.preset, MODEL_PRESETS)
        choice("--device", self.runtime.device, DEVICES)
        choice("--dtype", self.runtime.dtype, DTYPES)
        choice("--grad-reduce-dtype", self.runtime.grad_reduce_dtype, GRAD_REDUCE_DTYPES)
        choice("--on-nan", o.on_nan, ON_NAN)
        choice("--data-format", d.data_format, DATA_FORMATS)
        choice("--data-order", d.data_order, DATA_ORDERS)
        check_schedule(o)
        choice(
            "--activation-checkpointing",
            self.runtime.activation_checkpointing,
            ACTIVATION_CHECKPOINTING,
        )
        parse_log_to(self.runtime.log_to)
        choice("--log-errors", self.runtime.log_errors, LOG_ERRORS)
        parse_steps(self.runtime.profile_steps)
        non_negative(peak_tflops=self.runtime.peak_tflops)
        if not own_model:
            self._validate_model()
        check_layout(self, own_model)  # the axes, schedule, sequence, batch, gradients' group
        self._validate_checkpoint()
        self._validate_comm()
        return self

    def _validate_comm(self) -> None:
        """--compress, --allreduce, --ranks-per-node (meshwise.comm); what they need of the
        layout is ``check_layout``'s."""
        c = self.comm
        parse_compress(c.compress)
        choice("--allreduce", c.allreduce, ALGORITHMS)
        choice("--error-feedback", c.error_feedback, ("on", "off"))
        non_negative(
            ranks_per_node=c.ranks_per_node,
            compress_warmup_steps=c.compress_warmup_steps,
            topk_ramp_steps=c.topk_ramp_steps,
        )
        if self.runtime.grad_reduce_dtype == "bf16" and c.compress != "none":
            raise ValueError(
                f"--grad-reduce-dtype bf16 with --compress {c.compress}: the "
                "compressor decides what crosses the wire; valid: "
                "--grad-reduce-dtype fp32 with --compress, or --compress none"
            )

    def _validate_checkpoint(self) -> None:
        c = self.checkpoint
        for flag, value in (("--save-every", c.save_every), ("--keep-last", c.keep_last)):
            if value is not None and value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        non_negative(max_restarts=c.max_restarts)
        if not c.save:
            needs = [
                flag
                for flag, value in (
                    ("--save-every", c.save_every),
                    ("--keep-last", c.keep_last),
                    ("--max-restarts", c.max_restarts),
                    ("--resume auto", c.resume == "auto"),
                )
                if value
            ]
            if needs:
                raise ValueError(f"{needs[0]} needs --save DIR (where checkpoints go)")

    def _validate_model(self) -> None:
        m, d = self.model.resolved(), self.data
        if self.model.family != "llama":
            for name in LLAMA_ONLY + MOE_SETTINGS:
                if getattr(m, name) is not None:
                    raise ValueError(
                        f"{flag_name(name)} applies to the llama models, "
                        f"not --model {m.preset}; valid: --model "
                        f"{' or '.join(p for p in MODEL_PRESETS if 'llama' in p)}"
                    )
        positive(**{name: getattr(m, name) for name in LLAMA_ONLY if getattr(m, name) is not None})
        if m.d_model % m.n_head:
            raise ValueError(f"--d-model {m.d_model} is not divisible by --n-head {m.n_head}")
        # The family's own checks (grouped-query heads, rope scaling, dropout).
        family(self.model.family).make_config(
            {**self.model.sizes(max(m.vocab_size, 1)), "dropout": m.dropout}
        )
        if d.seq_len > m.block_size:
            whose = (
                f"--init-from {m.init_from}'s config.json" if m.init_from else f"preset {m.preset}"
            )
            raise ValueError(
                f"--seq-len {d.seq_len} exceeds the model's context of {m.block_size} "
                f"tokens (from {whose}); use --seq-len <= {m.block_size}"
            )


def recorded_section(section: type, recorded: dict):
    """A settings section (``OptimConfig``, ...) as a recorded configuration holds it (a
    checkpoint's): keys it lacks, written before they existed, take the dataclass's
    defaults; keys no longer known are left out."""
    known = {f.name for f in dataclasses.fields(section)}
    return section(**{k: v for k, v in recorded.items() if k in known})
