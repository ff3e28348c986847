"""The table of ``meshwise train``'s flags: one row per setting, (flag, config section,
field, type, help), in the order the help and the effective configuration list them.
``meshwise.cli.train_flags`` builds the parser, the TOML reader and the help from it.
"""

from __future__ import annotations

from meshwise.data.order import DATA_ORDERS
from meshwise.data.readers import DATA_FORMATS
from meshwise.train.config import (
    ACTIVATION_CHECKPOINTING,
    DEVICES,
    DTYPES,
    GRAD_REDUCE_DTYPES,
    MODEL_PRESETS,
    ON_NAN,
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
