"""The flags of ``meshwise train``, their TOML form, and where each value came from.

One table (``TRAIN_FLAGS``) drives the parser, the TOML reader and the help; defaults live
only in ``meshwise.train.config``'s dataclasses. A new setting: a field with its default,
its check in ``TrainConfig.validate``, a row here and one in docs/flags.md (tested).
"""

from __future__ import annotations

import argparse
import dataclasses

from meshwise.data.order import DATA_ORDERS
from meshwise.data.readers import DATA_FORMATS
from meshwise.train.config import (
    ACTIVATION_CHECKPOINTING,
    DEVICES,
    DTYPES,
    GRAD_REDUCE_DTYPES,
    MODEL_PRESETS,
    ON_NAN,
    TrainConfig,
)
from meshwise.train.config import SCHEDULES as PIPELINE_SCHEDULES
from meshwise.train.lr_schedule import DECAY_SHAPES, SCHEDULES

# (flag, config section, field, type, help). The help's default is added from
# ``TrainConfig()`` (or ``DEFAULT_TEXT``), so the dataclasses are the one source.
# fmt: off
TRAIN_FLAGS = [
    ("--dp", "parallel", "dp", int, "data-parallel ranks"),
    ("--tp", "parallel", "tp", int, "tensor-parallel ranks"),
    ("--pp", "parallel", "pp", int, "pipeline stages"),
    ("--cp", "parallel", "cp", int,
     "context-parallel ranks: every sequence split into 2 x cp load-balanced chunks, attention "
     "by a ring of key/value blocks (--seq-len a multiple of 2 x cp)"),
    ("--sp", "parallel", "sp", bool,
     "sequence parallelism (with --tp > 1): the sequence split across the tp ranks between "
     "their layers (norms, dropout, residuals), 1/tp of those activations per rank"),
    ("--schedule", "parallel", "schedule", str,
     f"pipeline schedule: {', '.join(PIPELINE_SCHEDULES)}; zb-h1, zbv and dualpipev split each "
     "backward into the input gradient (B) and the weight gradients (W, deferred into "
     "bubbles)"),
    ("--virtual-stages", "parallel", "virtual_stages", int,
     "model chunks per pipeline rank: 2 or more for interleaved-1f1b, 2 for zbv and "
     "dualpipev (a V: rank r holds stages r and 2*pp-1-r)"),
    ("--micro-batches", "parallel", "micro_batches", int,
     "pipeline micro-batches per step (interleaved-1f1b: a multiple of --pp; dualpipev: at "
     "least 2 x --pp)"),
    ("--zero", "parallel", "zero", int,
     "ZeRO stage: 0 none, 1 optimizer state, 2 +gradients, 3 +parameters"),
    ("--ep", "parallel", "ep", int,
     "expert parallelism: each MoE layer's experts split over ep ranks borrowed from dp x cp "
     "(ep divides dp x cp and the experts; each run of ep consecutive dp x cp ranks is an "
     "ep group)"),
    ("--dp-shard", "parallel", "dp_shard", int,
     "hybrid sharding: ZeRO shards over N consecutive dp ranks (a replica, within a node) "
     "and the dp / N replicas all-reduce their shards' gradients, through --compress and "
     "--allreduce (N divides dp; with --ep, ep divides N x cp; default: all of dp)"),
    ("--reshard-after-forward", "parallel", "reshard_after_forward", bool,
     "with --zero 3 and --pp > 1: gather each unit for every micro-batch's forward and "
     "backward and reduce-scatter every micro-batch's gradient (about two units in memory) "
     "instead of once per step (the stage's parameters and gradients in full during the "
     "step, the fewest bytes); without a pipeline ZeRO-3 always does so"),
    ("--grad-accum", "data", "grad_accum", int,
     "gradient accumulation micro-steps per optimizer step"),
    ("--model", "model", "preset", str, f"model preset: {', '.join(MODEL_PRESETS)}"),
    ("--n-layer", "model", "n_layer", int, "override the preset's number of layers"),
    ("--n-head", "model", "n_head", int, "override the preset's number of attention heads"),
    ("--d-model", "model", "d_model", int, "override the preset's hidden size"),
    ("--dropout", "model", "dropout", float,
     "dropout probability (embeddings, residual branches, attention weights); its masks "
     "are the same whatever the layout"),
    ("--block-size", "model", "block_size", int,
     "override the preset's context length (GPT: learned positions; llama: the longest "
     "sequence)"),
    ("--n-kv-head", "model", "n_kv_head", int,
     "llama: key/value heads of grouped-query attention (divides --n-head; tp must divide it)"),
    ("--ffn-hidden-size", "model", "ffn_hidden_size", int,
     "llama: width of the SwiGLU MLP"),
    ("--n-experts", "model", "n_experts", int,
     "llama: routed experts per MoE layer (0: a dense MLP in every layer)"),
    ("--experts-per-token", "model", "experts_per_token", int,
     "llama: experts each token is routed to (top-k, at most --n-experts)"),
    ("--moe-ffn-hidden-size", "model", "moe_ffn_hidden_size", int,
     "llama: each expert's SwiGLU width (0: --ffn-hidden-size)"),
    ("--shared-expert-size", "model", "shared_expert_size", int,
     "llama: width of a shared SwiGLU expert every token passes through (0: none)"),
    ("--first-dense-layers", "model", "first_dense_layers", int,
     "llama: the first layers keep a dense MLP"),
    ("--moe-every", "model", "moe_every", int,
     "llama: layer i (from --first-dense-layers on) is MoE iff (i + 1) is a multiple of it"),
    ("--router-score", "model", "router_score", str,
     "llama: softmax (Mixtral, Qwen-MoE) or sigmoid (DeepSeek-V3, with a routing bias)"),
    ("--moe-aux-loss-coef", "model", "aux_loss_coef", float,
     "load-balancing loss weight (Switch Transformer's, per MoE layer, over the global "
     "micro-batch; reported as aux_loss)"),
    ("--moe-bias-update-rate", "model", "bias_update_rate", float,
     "aux-loss-free balancing: after each step every expert's routing bias moves by this "
     "times the sign of its load error (token counts of the whole step)"),
    ("--rope-theta", "model", "rope_theta", float,
     "llama: base of the rotary position embedding's wavelengths"),
    ("--norm-eps", "model", "norm_eps", float, "llama: epsilon of the RMSNorms"),
    ("--init-from", "model", "init_from", str,
     "a local Hugging Face Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen3-MoE, Qwen2-MoE or "
     "GPT-2 directory (config.json + "
     "safetensors): the model's sizes "
     "come from its config.json and its weights start from the directory's; its "
     "tokenizer.json is the default --tokenizer"),
    ("--lora-rank", "lora", "lora_rank", int,
     "LoRA: train rank-R adapters beside the frozen weights (0: full fine-tuning); "
     "docs/lora.md"),
    ("--lora-alpha", "lora", "lora_alpha", float,
     "LoRA: the adapters' output scaled by alpha / rank"),
    ("--lora-dropout", "lora", "lora_dropout", float, "LoRA: dropout on the adapters' input"),
    ("--lora-targets", "lora", "lora_targets", str,
     "LoRA: comma-separated Hugging Face module names (q_proj,v_proj,...) or all-linear "
     "(every linear layer but the output head)"),
    ("--lora-init", "lora", "lora_init", str,
     "LoRA: A Kaiming-uniform (kaiming, PEFT's default) or N(0, 1/rank^2) (gaussian); B zero"),
    ("--lora-from", "lora", "lora_from", str,
     "LoRA: start the adapters from a PEFT adapter directory (adapter_config.json + "
     "adapter_model.safetensors); its config sets rank, alpha, dropout and targets"),
    ("--quantize-base", "lora", "quantize_base", str,
     "LoRA: hold the frozen linear weights as 4-bit NormalFloat blocks (nf4, QLoRA) or as "
     "they are (none)"),
    ("--vocab-size", "model", "vocab_size", int,
     "vocabulary of the model; needed for a .bin with token ids past 255"),
    ("--seq-len", "data", "seq_len", int, "tokens per sequence"),
    ("--batch-size", "data", "batch_size", int,
     "global sequences per optimizer step, whatever the layout"),
    ("--data", "data", "path", str, "a text, JSON lines (.jsonl), Parquet or CSV file, a folder "
     "of them, a datasets save_to_disk folder, or a .bin token file (meshwise data prepare); "
     "each text file, and each record, is one document"),
    ("--text-field", "data", "text_field", str,
     "the field (JSON lines) or column (Parquet, CSV, datasets) holding each record's text"),
    ("--data-format", "data", "data_format", str,
     f"{', '.join(DATA_FORMATS)}: auto tells each file by its name (.jsonl, .parquet, .csv, "
     ".json) and first bytes, and refuses to read a file that looks like JSON lines as text"),
    ("--skip-bad-records", "data", "skip_bad_records", bool,
     "skip a malformed JSON line, or a record without text in the field, and count them, "
     "instead of stopping at the first"),
    ("--data-order", "data", "data_order", str,
     f"{' or '.join(DATA_ORDERS)}: random windows drawn with replacement, or epochs (every "
     "token of the train split once per epoch, windows shuffled per epoch by --seed); both "
     "resume exactly on any layout"),
    ("--token-dtype", "data", "token_dtype", str,
     "uint16 or uint32: the ids of a .bin without meshwise's sidecar, when its contents do "
     "not settle it (a .bin meshwise wrote says so itself)"),
    ("--cache-dir", "data", "cache_dir", str,
     "where built token files are cached"),
    ("--tokenizer", "data", "tokenizer", str,
     "a Hugging Face tokenizer.json (or a folder holding one): encodes text --data, sets "
     "the vocabulary, decodes samples; a .bin must have been prepared with it"),
    ("--format", "data", "format", str,
     "text, or chat: --data holds chat records ({\"messages\": [{\"role\", \"content\"}, "
     "...]}) rendered with --chat-template into packed rows of whole conversations (a .bin "
     "prepared with --format chat says so itself)"),
    ("--chat-template", "data", "chat_template", str,
     "with --format chat: tokenizer (the chat_template of the tokenizer's "
     "tokenizer_config.json), tokenizer:NAME (one of its named templates), chatml (built "
     "in), or a .jinja file"),
    ("--loss-on", "data", "loss_on", str,
     "chat data: assistant (the loss only on the tokens of assistant messages) or all "
     "(every token but each conversation's first); the loss is the mean over the global "
     "batch's labelled tokens"),
    ("--long-conversations", "data", "long_conversations", str,
     "chat data: a conversation longer than --seq-len + 1 tokens is cut to its first "
     "--seq-len + 1 (truncate, counted at the start) or stops the run before it starts "
     "(refuse)"),
    ("--document-mask", "data", "document_mask", bool,
     "attention only within each document of a packed sequence, positions counted from "
     "each document's start (documents: separated by the tokenizer's end-of-text token; "
     "chat data: conversations); any layout"),
    ("--eval-every", "data", "eval_every", int,
     "validation loss every N steps; 0: only at the end"),
    ("--eval-batches", "data", "eval_batches", int, "global batches per evaluation"),
    ("--sample-tokens", "data", "sample_tokens", int,
     "print a sample of N generated tokens at the end"),
    ("--seed", "data", "seed", int, "seed for initialisation and batches"),
    ("--steps", "optim", "steps", int, "optimizer steps"),
    ("--lr", "optim", "lr", float, "peak learning rate"),
    ("--warmup-steps", "optim", "warmup_steps", int,
     "linear warmup steps before the schedule"),
    ("--lr-schedule", "optim", "lr_schedule", str,
     f"{', '.join(SCHEDULES)} after the warmup: cosine decay to --min-lr-ratio x --lr at the "
     "last step; wsd (warmup-stable-decay) holds --lr until the last --decay-steps; "
     "constant holds it"),
    ("--decay-steps", "optim", "decay_steps", int,
     "wsd: the steps of the final decay"),
    ("--decay-shape", "optim", "decay_shape", str,
     f"wsd: the decay's curve, {', '.join(DECAY_SHAPES)} (sqrt: 1 - sqrt of the progress)"),
    ("--min-lr-ratio", "optim", "min_lr_ratio", float,
     "where cosine and wsd end, as a share of --lr"),
    ("--lr-restart", "optim", "lr_restart", bool,
     "resuming with another schedule (--steps, --lr, --lr-schedule, ...) than the "
     "checkpoint's: start it afresh at the step resumed, warmup included, instead of "
     "refusing"),
    ("--weight-decay", "optim", "weight_decay", float,
     "AdamW weight decay on matrices"),
    ("--clip", "optim", "clip", float, "max global gradient norm; 0 turns clipping off"),
    ("--beta1", "optim", "beta1", float, "AdamW's first-moment decay"),
    ("--beta2", "optim", "beta2", float, "AdamW's second-moment decay"),
    ("--on-nan", "optim", "on_nan", str,
     f"on a non-finite loss or gradient: {' or '.join(ON_NAN)}"),
    ("--max-skipped-steps", "optim", "max_skipped_steps", int,
     "with --on-nan skip: stop after more than N skipped steps in a row"),
    ("--bucket-mb", "comm", "bucket_mb", float,
     "gradient bucket size in MB; with --zero 3, consecutive layers are gathered together "
     "up to this size"),
    ("--timeout-s", "comm", "timeout_s", float,
     "seconds a collective, or the start of the other ranks, may wait before the job fails "
     "(1 to 31536000); under torchrun give its rendezvous the same: --rdzv-conf timeout=S"),
    ("--compress", "comm", "compress", str,
     "dp gradient compression: none, fp16, bf16, int8, topk:FRACTION, powersgd:RANK"),
    ("--error-feedback", "comm", "error_feedback", str,
     "on or off: carry what compression did not send into the next step"),
    ("--compress-warmup-steps", "comm", "compress_warmup_steps", int,
     "uncompressed steps before top-k or PowerSGD starts"),
    ("--topk-ramp-steps", "comm", "topk_ramp_steps", int,
     "steps over which top-k's density falls from 25%% to FRACTION after the warm-up"),
    ("--allreduce", "comm", "allreduce", str,
     "dp all-reduce algorithm: native, ring, tree, hierarchical, adaptive"),
    ("--ranks-per-node", "comm", "ranks_per_node", int,
     "ranks per node for hierarchical and adaptive (emulates nodes on one machine)"),
    ("--device", "runtime", "device", str,
     f"{', '.join(DEVICES)}: auto picks cuda (NCCL) when available, else cpu (gloo)"),
    ("--dtype", "runtime", "dtype", str,
     f"{', '.join(DTYPES)}: bf16 is mixed precision: bf16 parameters, activations and "
     "pipeline messages, fp32 master weights and AdamW state (sharded by ZeRO); auto "
     "(the default) is bf16 on CUDA GPUs with bfloat16 (compute capability 8.0+), else fp32"),
    ("--grad-reduce-dtype", "runtime", "grad_reduce_dtype", str,
     f"{' or '.join(GRAD_REDUCE_DTYPES)}: the dtype gradients are accumulated and summed "
     "over dp in (with --dtype bf16; fp32 keeps every micro-step's bits)"),
    ("--activation-checkpointing", "runtime", "activation_checkpointing", str,
     f"{' or '.join(ACTIVATION_CHECKPOINTING)}: full keeps only each transformer block's "
     "input in forward and recomputes the rest in backward (less memory, more compute); "
     "selective keeps the matmul and attention outputs and recomputes the element-wise "
     "rest (most of the saving at a fraction of the recompute)"),
    ("--compile", "runtime", "compile", bool,
     "torch.compile each transformer block and, at tp 1, the loss (fullgraph; collectives "
     "and MoE dispatch run eager around the compiled compute); the first step pays the "
     "compile, kept under --cache-dir's inductor folder for the next run"),
    ("--metrics", "runtime", "metrics", str, "write one JSON line per step to this file"),
    ("--log-to", "runtime", "log_to", str,
     "experiment loggers, comma-separated: tensorboard, wandb, mlflow (each an optional "
     "extra: pip install 'meshwise[tensorboard]'); every metric per step, the configuration "
     "as hyper-parameters; W&B offline without an API key, MLflow in a local file store"),
    ("--log-dir", "runtime", "log_dir", str,
     "where the loggers keep the run (a resumed run with the same folder goes on in the "
     "same runs)"),
    ("--run-name", "runtime", "run_name", str, "the run's name in the loggers"),
    ("--log-errors", "runtime", "log_errors", str,
     "a logger that fails during the run: warn (one line, that logger off, training goes "
     "on) or fatal (the run stops)"),
    ("--project", "runtime", "project", str,
     "the W&B project and MLflow experiment"),
    ("--profile-steps", "runtime", "profile_steps", str,
     "A-B: record steps A to B (1-based) with torch.profiler on every rank, one Chrome "
     "trace per rank with meshwise's named ranges"),
    ("--profile-dir", "runtime", "profile_dir", str, "where the profiler's traces go"),
    ("--peak-tflops", "runtime", "peak_tflops", float,
     "one device's peak TFLOP/s that MFU is measured against (a GPU meshwise has no data "
     "sheet for, or to skip the CPU's start-up measurement); 0: the GPU's data sheet, or a "
     "matrix multiply measured at start-up"),
    ("--check-replicas-every", "runtime", "check_replicas_every", int,
     "every N steps, check that tp-replicated parameters (norms, biases, positions) are "
     "equal on every tp rank, under any ZeRO stage (with --dp-shard, also that every replica "
     "holds bitwise the same parameters); 0: never"),
    ("--log-every", "runtime", "log_every", int,
     "progress line every N steps when output is not a terminal"),
    ("--save", "checkpoint", "save", str,
     "write sharded checkpoints under this directory (step-NNNNNNNN/ each); one job at a "
     "time: the directory is locked while the job runs"),
    ("--save-every", "checkpoint", "save_every", int,
     "checkpoint every N steps, and at the end"),
    ("--keep-last", "checkpoint", "keep_last", int,
     "keep only the newest K checkpoints of this run's lineage in --save (never the one it "
     "resumed from; other branches' are left alone)"),
    ("--resume", "checkpoint", "resume", str,
     "continue from a checkpoint, or a --save directory's newest one; 'auto': the newest "
     "in --save if there is one, else start fresh. Any layout can resume any other"),
    ("--branch", "checkpoint", "branch", bool,
     "resuming a checkpoint older than the newest in --save: move the newer ones into "
     "--save/set-aside-RUN/ and train on (without it the run is refused, as it would "
     "collide with them)"),
    ("--max-restarts", "checkpoint", "max_restarts", int,
     "when a rank dies, restart the job from the newest checkpoint up to N times (not under "
     "torchrun: use torchrun --max-restarts with --resume auto)"),
]
# fmt: on


# Defaults that are not a plain value of the dataclass field.
DEFAULT_TEXT = {
    "dp": "2 for the CPU demo (no layout flags), else 1; under torchrun: the world / "
    "(cp x tp x pp)",
    "sp": "off",
    "micro_batches": "pp",
    "n_layer": "the preset's",
    "n_head": "the preset's",
    "d_model": "the preset's",
    "block_size": "the preset's",
    "n_kv_head": "the preset's",
    "ffn_hidden_size": "the preset's",
    "rope_theta": "the preset's",
    "n_experts": "the preset's (0: dense)",
    "experts_per_token": "the preset's (2)",
    "moe_ffn_hidden_size": "the preset's (0)",
    "shared_expert_size": "the preset's (0)",
    "first_dense_layers": "the preset's (0)",
    "moe_every": "the preset's (1)",
    "router_score": "the preset's (softmax)",
    "aux_loss_coef": "0: none",
    "bias_update_rate": "0: none",
    "norm_eps": "the preset's",
    "init_from": "none: the initialisation drawn from --seed",
    "lora_from": "none: A drawn from --seed, B zero",
    "vocab_size": "the tokenizer's, else the data's (byte-level: 256)",
    "tokenizer": "byte-level, vocab 256; or the one a .bin was prepared with",
    "path": "the Python standard library's sources, byte-level",
    "cache_dir": "$MESHWISE_CACHE or ~/.cache/meshwise",
    "metrics": "none",
    "save": "none",
    "resume": "none: start fresh",
    "log_dir": "DIR/logs with --save DIR, else runs/RUN_NAME",
    "run_name": "--save's folder name, else run-DATE-TIME",
    "profile_steps": "none",
    "profile_dir": "LOG_DIR/profile",
    "save_every": "only at the end",
    "keep_last": "keep all",
    "token_dtype": "the sidecar's; without one, uint16 unless the file could be uint32",
    "chat_template": "tokenizer; or the one a .bin was prepared with",
    "document_mask": "off",
    "decay_steps": "the last fifth of the steps",
    "skip_bad_records": "off",
    "lr_restart": "off",
    "ranks_per_node": "torchrun's LOCAL_WORLD_SIZE; locally, every rank on one node",
    "dp_shard": "all of dp",
}
BY_FIELD = {field: (flag, section, kind) for flag, section, field, kind, _ in TRAIN_FLAGS}


class ConfigError(ValueError):
    """A flag or TOML value that cannot be used; the message names it."""


def default_text(section: str, field: str) -> str:
    if field in DEFAULT_TEXT:
        return DEFAULT_TEXT[field]
    return str(getattr(getattr(TrainConfig(), section), field))


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    for flag, section, field, kind, help_text in TRAIN_FLAGS:
        help_text = f"{help_text} (default: {default_text(section, field)})"
        if kind is bool:  # a switch: given means true (``key = true`` in TOML)
            parser.add_argument(
                flag,
                dest=field,
                action="store_const",
                const=True,
                default=argparse.SUPPRESS,
                help=help_text,
            )
        else:
            parser.add_argument(
                flag, dest=field, type=kind, default=argparse.SUPPRESS, help=help_text
            )
    parser.add_argument(
        "--config",
        dest="config_file",
        default=argparse.SUPPRESS,
        help="TOML file with the same keys; flags given here override it",
    )


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, dict[str, str]]:
    """Defaults, then the TOML file, then the flags given (not yet validated).

    Returns the configuration and, per field set, where it came from: ``"toml"``
    or ``"flag"`` (every other field has its default).
    """
    cfg = TrainConfig()
    values, origins = {}, {}
    if getattr(args, "config_file", None):
        values = read_toml(args.config_file)
        origins = dict.fromkeys(values, "toml")
    given = {field: getattr(args, field) for field in BY_FIELD if hasattr(args, field)}
    origins.update(dict.fromkeys(given, "flag"))
    for field, value in {**values, **given}.items():
        _, section, _ = BY_FIELD[field]
        setattr(getattr(cfg, section), field, value)
    chosen = cfg.parallel.micro_batches
    if "micro_batches" in origins and chosen < 1:  # the field's 0 means "not given"
        raise ConfigError(
            f"--micro-batches {chosen} is not a count of micro-batches; valid: 1 or more "
            "(leave it out for the default, --pp)"
        )
    return cfg, origins


def read_toml(path: str) -> dict:
    """Flat or sectioned keys of a TOML file, each checked for its section and type."""
    import tomllib

    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: no such file") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"--config {path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} "
            f"at offset {exc.start}); TOML files are UTF-8"
        ) from None
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigError(f"--config {path}: not a readable TOML file ({exc})") from None
    sections = sorted({f.name for f in dataclasses.fields(TrainConfig)})
    flat = {}
    spelled: dict[str, str] = {}  # field -> where the file set it
    for key, value in raw.items():
        if isinstance(value, dict):
            if key not in sections:
                raise ConfigError(
                    f"--config {path}: unknown section [{key}]; valid: {', '.join(sections)}"
                )
            items: list[tuple[str, object, str | None]] = [
                (name, item, key) for name, item in value.items()
            ]
        else:
            items = [(key, value, None)]
        for name, item, section in items:
            field, kind = _toml_key(path, name, section)
            where = f"[{section}] {name}" if section else name
            if field in spelled:  # two spellings of one setting: neither may win silently
                raise ConfigError(
                    f"--config {path}: {spelled[field]!r} and {where!r} both set "
                    f"{BY_FIELD[field][0]}; keep one"
                )
            spelled[field] = where
            flat[field] = _typed(path, name, item, kind)
    return flat


def _toml_key(path: str, name: str, section: str | None) -> tuple[str, type]:
    by_name = {}
    for flag, flag_section, field, kind, _ in TRAIN_FLAGS:
        by_name[flag.lstrip("-")] = by_name[field] = (flag_section, field, kind)
    if name not in by_name:
        raise ConfigError(
            f"--config {path}: unknown key {name!r}; valid keys are the flag "
            "names, e.g. batch-size, dp, lr"
        )
    want, field, kind = by_name[name]
    if section is not None and section != want:
        raise ConfigError(f"--config {path}: {name!r} belongs under [{want}], not [{section}]")
    return field, kind


def _typed(path: str, name: str, value, kind: type):
    """``value`` as ``kind``, refusing conversions that would change it (2.7 -> 2, true -> 1)."""
    ok = {
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        bool: isinstance(value, bool),
    }[kind]
    if not ok:
        wanted = {int: "an integer", float: "a number", str: "a string", bool: "true or false"}[
            kind
        ]
        raise ConfigError(f"--config {path}: {name} = {value!r} is not {wanted}")
    return kind(value)


def effective_config(cfg: TrainConfig, origins: dict[str, str]) -> list[str]:
    """One line per setting: ``--flag value``, marked ``[toml]`` / ``[flag]`` when not a default."""
    lines = []
    for flag, section, field, _, _ in TRAIN_FLAGS:
        value = getattr(getattr(cfg, section), field)
        mark = f"  [{origins[field]}]" if field in origins else ""
        lines.append(f"{flag} {value}{mark}")
    return lines
