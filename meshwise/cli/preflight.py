"""Checks made in the launching process before any rank starts: ``prepare`` builds or finds
the token file (ranks never race to), checks the data, devices, checkpoints and launch,
and computes the run state; a failure exits 2 with one line.
"""

from __future__ import annotations

import logging
from pathlib import Path

from meshwise.checkpoint import resume
from meshwise.cli import capacity, launch
from meshwise.cli.checkpoint_dir import check_start
from meshwise.data.batches import BatchSource
from meshwise.data.chat_files import resolve_chat_data
from meshwise.data.chat_templates import load_template
from meshwise.data.dataset import TokenDataset, read_meta, recorded_tokenizer, resolve_data
from meshwise.data.files import available_cpus
from meshwise.data.readers import ReadOptions
from meshwise.data.tokenizer import ByteTokenizer, check_vocab_fits, load_tokenizer
from meshwise.device import choice
from meshwise.train.config import TrainConfig
from meshwise.train.init_from import check_init_from
from meshwise.train.log_folder import check_log_dir
from meshwise.train.loggers import missing_extra, parse_log_to
from meshwise.train.lora_setup import check_lora
from meshwise.train.run_state import RunState

log = logging.getLogger("meshwise")


def prepare(cfg: TrainConfig, run_id: str = "") -> tuple[Path, RunState]:
    """Validate against the data and the launch environment; return the token file and
    the run state of job ``run_id``'s first launch."""
    if launch.under_torchrun():
        check_torchrun(cfg)
    device = choice.resolve_device(cfg.runtime.device)
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda but no CUDA device is available; valid: cpu, auto")
        local = cfg.parallel.dims.world_size
        if not launch.under_torchrun() and local > torch.cuda.device_count():
            raise ValueError(
                f"{cfg.parallel.axes_text} = {local} local ranks need {local} "
                f"GPUs, but {torch.cuda.device_count()} are visible; use fewer "
                "ranks, or "
                "torchrun across nodes"
            )
        check_gpu_dtypes(cfg)
    if cfg.runtime.compile:
        from meshwise.apply.compile import compiler_problem, keep_kernels_in

        keep_kernels_in(cfg.data.cache_dir)  # before the check below reads inductor's default
        problem = compiler_problem(device)
        if problem:
            raise ValueError(problem)
    if cfg.runtime.metrics:
        check_writable_file(cfg.runtime.metrics, "--metrics")
    missing = missing_extra(parse_log_to(cfg.runtime.log_to))
    if missing:
        raise ValueError(missing)
    if device == "cpu" and cfg.runtime.dtype == "bf16":
        slowdown = bf16_slowdown()
        if slowdown > 2:
            log.warning(
                "warning: --dtype bf16: a bf16 matmul measured %.0fx slower than fp32 on "
                "this CPU (no native bf16 support); fp32 will train faster",
                slowdown,
            )
    check_init_from(cfg)
    path = prepare_data(cfg)
    dataset = TokenDataset(
        path,
        cfg.data.seq_len,
        vocab_size=cfg.model.vocab_size,
        token_dtype=cfg.data.token_dtype,
        data_order=cfg.data.data_order,
    )
    check_batches(cfg, dataset)
    check_lora(cfg, dataset.vocab_size)
    num_params = capacity.parameter_count(cfg, dataset.vocab_size)
    capacity.check_memory(cfg, num_params, dataset.vocab_size, device)
    c = cfg.checkpoint
    if c.save:
        resume.check_save_dir(c.save)
        resume.check_not_overwriting(c.save, c.resume)
    start = resume.find_resume(c.resume, c.save)
    if c.resume == "auto" and start is None:
        log.info("%s", fresh_start_line(c.save))
    run = RunState.at_launch(cfg, path, run_id)
    ckpt = None
    if start is not None:
        ckpt = resume.open_verified(start, cfg.model.sizes(dataset.vocab_size))
        check_same_tokenizer(ckpt.meta.get("config", {}), cfg, run.tokenizer_digest)
    run = run.starting_from(cfg.optim, start)
    if parse_log_to(cfg.runtime.log_to) and run.log_dir:  # before a rank writes there
        check_log_dir(run.log_dir, resuming=bool(cfg.checkpoint.resume))
    check_start(cfg, run, ckpt, capacity.checkpoint_bytes(cfg, num_params))
    return path, run


def fresh_start_line(save_dir: str | None) -> str:
    """What ``--resume auto`` says when ``--save`` holds no checkpoint to resume."""
    return f"--resume auto: {save_dir} holds no complete checkpoint yet; starting at step 1"


def check_torchrun(cfg: TrainConfig) -> None:
    """torchrun's world matches the layout; restarts are torchrun's to make."""
    world = launch.torchrun_world_size()
    if world != cfg.parallel.dims.world_size:
        flags = "--" + cfg.parallel.axes_text.replace(" x ", " x --")
        raise ValueError(
            f"torchrun started {world} processes but {flags} = "
            f"{cfg.parallel.dims.world_size}; launch with "
            f"--nproc-per-node x --nnodes = {cfg.parallel.dims.world_size}"
        )
    if cfg.checkpoint.max_restarts:
        # Each node would restart on its own, at its own time: the ranks could never meet.
        raise ValueError(
            f"--max-restarts {cfg.checkpoint.max_restarts} does not work under "
            "torchrun (every node would restart on its own); valid: torchrun "
            f"--max-restarts {cfg.checkpoint.max_restarts} with --save DIR "
            "--resume auto"
        )


def prepare_data(cfg: TrainConfig) -> Path:
    """The token file for ``--data``, encoded with ``--tokenizer`` (or the one a ``.bin`` brings);
    records the tokenizer's path in ``cfg.data`` and takes the vocabulary from it when
    ``--vocab-size`` is not given.
    """
    d = cfg.data
    tokenizer = load_tokenizer(d.tokenizer) if d.tokenizer else None
    if tokenizer is not None:
        check_vocab_fits(tokenizer, cfg.model.vocab_size)
    options = ReadOptions(d.text_field, d.data_format, d.skip_bad_records)
    if d.format == "chat" and not str(d.path or "").endswith(".bin"):
        if d.path is None:
            raise ValueError("--format chat needs --data: chat records with 'messages'")
        template = load_template(d.chat_template, tokenizer.path if tokenizer is not None else None)
        path = resolve_chat_data(
            d.path, d.cache_dir, tokenizer or ByteTokenizer(), template, options
        )
    else:
        path = resolve_data(
            d.path,
            d.cache_dir,
            tokenizer,
            num_workers=available_cpus(),
            token_dtype=d.token_dtype,
            options=options,
        )
    tokenizer = tokenizer or recorded_tokenizer(path, d.token_dtype)
    if tokenizer is not None and tokenizer.path is not None:
        d.tokenizer = tokenizer.path
        cfg.model.vocab_size = cfg.model.vocab_size or tokenizer.vocab_size
        log.info("tokenizer: %s", tokenizer.describe())
    return path


def check_batches(cfg: TrainConfig, dataset: TokenDataset) -> None:
    """What the data holds against ``--format``, ``--document-mask``, ``--loss-on`` and
    ``--long-conversations`` (chat data: its template goes into the configuration and its
    digest into the run state, so checkpoints and ``meshwise generate --chat`` know it);
    says what packing did."""
    d = cfg.data
    source = BatchSource(dataset, d.document_mask, d.loss_on, d.long_conversations)
    if source.chat is None and d.format == "chat":
        raise ValueError(
            f"--format chat: --data {d.path} holds no chat records (prepare them "
            "with meshwise data prepare --format chat)"
        )
    if source.chat is not None and source.rows is not None:  # the rows packed from it
        chat = read_meta(dataset.path, d.token_dtype)["chat"]
        d.format, d.chat_template = "chat", chat["template"]
        log.info("chat data (template %s): %s", chat["template"], source.summary())
        if source.rows.truncated:
            log.warning(
                "warning: %s conversations longer than --seq-len %d + 1 tokens are "
                "truncated (--long-conversations refuse stops instead)",
                f"{source.rows.truncated:,}",
                d.seq_len,
            )


def check_same_tokenizer(saved: dict, cfg: TrainConfig, digest: str | None) -> None:
    """A run resumes only with the tokenizer its checkpoint was trained with; ``saved``:
    the configuration the checkpoint records, ``digest``: this run's tokenizer's."""
    theirs = saved.get("data", {}).get("tokenizer_digest")
    if theirs != digest:
        name = saved.get("data", {}).get("tokenizer") or "byte-level"
        raise ValueError(
            f"--resume: the checkpoint was trained with the tokenizer {name} "
            f"(digest {theirs}), this run has {cfg.data.tokenizer or 'byte-level'} "
            f"(digest {digest}); valid: --tokenizer {name}"
        )


def check_gpu_dtypes(cfg: TrainConfig) -> None:
    """bf16 compute needs compute capability 8.0; bf16 on the wire, NCCL 2.10. Asked of
    a child process (``choice.gpu_facts``): this one creates no CUDA context."""
    bf16_wire = cfg.comm.compress == "bf16" or cfg.runtime.dtype == "bf16"
    if not bf16_wire:
        return
    facts = choice.gpu_facts()
    if cfg.runtime.dtype == "bf16":
        for gpu in facts["gpus"]:
            if tuple(gpu["capability"]) < (8, 0):
                raise ValueError(
                    f"--dtype bf16: {gpu['name']} has no bfloat16 support (CUDA "
                    "needs compute capability 8.0 or newer); valid here: --dtype "
                    "fp32"
                )
    nccl = facts["nccl"]
    if nccl is not None and nccl < (2, 10):
        what = "--dtype bf16" if cfg.runtime.dtype == "bf16" else "--compress bf16"
        raise ValueError(
            f"{what}: this PyTorch's NCCL {'.'.join(map(str, nccl))} carries no "
            "bfloat16 (2.10 or newer does); valid here: --dtype fp32 and "
            "--compress none, fp16, int8, topk:F, powersgd:R"
        )


def bf16_slowdown(size: int = 256, repeats: int = 5) -> float:
    """Time of a bf16 matmul over an fp32 one here (median of ``repeats``).

    On one thread: the launcher forks the ranks afterwards, and a thread pool
    must not exist at a fork (``meshwise.cli.launch.start_method``).
    """
    import statistics
    import time

    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {}
        for dtype in (torch.float32, torch.bfloat16):
            a = torch.randn(size, size).to(dtype)
            runs = []
            for _ in range(repeats):
                start = time.perf_counter()
                a @ a
                runs.append(time.perf_counter() - start)
            times[dtype] = statistics.median(runs)
    finally:
        torch.set_num_threads(threads)
    return times[torch.bfloat16] / max(times[torch.float32], 1e-9)


def check_writable_file(path: str, flag: str) -> None:
    """Create ``path``'s folder and the file itself now, or say why it cannot be."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot write there ({exc.strerror or exc})") from None
