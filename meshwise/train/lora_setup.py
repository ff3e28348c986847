"""LoRA in a run: ``--lora-from``'s settings (reading flags), the checks before any rank
starts (targets, rank, the adapter's tensors), and each rank's values of the adapters and
of the frozen weights they sit beside.
"""

from __future__ import annotations

from meshwise.apply.lora import ADAPTER_NAMES, hold_frozen, targeted_layers, with_adapter_values
from meshwise.apply.nf4 import BLOCK_SIZE, LINEAR_TYPES, quantize_frozen
from meshwise.geometry.init import on_meta
from meshwise.geometry.params import ep_split
from meshwise.hf import peft
from meshwise.train.config import TrainConfig, flag_name

# adapter_config.json's key of each setting it gives
FROM_CONFIG = {"lora_rank": "r", "lora_alpha": "lora_alpha", "lora_dropout": "lora_dropout"}


def apply_lora_from(cfg: TrainConfig, origins: dict[str, str]) -> None:
    """Take rank, alpha, dropout and targets from ``--lora-from``'s adapter_config.json
    (ValueError for a flag that contradicts it)."""
    lora = cfg.lora
    if not lora.lora_from:
        return
    config = peft.read_config(lora.lora_from)
    given = dict(FROM_CONFIG)
    targets = config.get("target_modules")
    if isinstance(targets, str):  # PEFT also takes a regular expression or all-linear
        targets = [targets]
    values = {key: config.get(stored) for key, stored in given.items()}
    values["lora_targets"] = ",".join(sorted(targets or []))
    for field, value in values.items():
        if value in (None, ""):
            raise ValueError(f"--lora-from {lora.lora_from}: {peft.CONFIG} gives no {field}")
        now = getattr(lora, field)
        if field in origins and now != value and not _same_targets(field, now, value):
            flag = flag_name(field)
            raise ValueError(
                f"{flag} {now} contradicts --lora-from {lora.lora_from}: its {peft.CONFIG} "
                f"has {given.get(field, 'target_modules')} {value}; leave {flag} out"
            )
        setattr(lora, field, type(now)(value))
        origins.setdefault(field, "lora-from")


def _same_targets(field: str, now, value) -> bool:
    return field == "lora_targets" and sorted(now.split(",")) == value.split(",")


def _whole_model(cfg: TrainConfig, vocab_size: int):
    """The whole model on meta, and its plan."""
    from meshwise.models.families import family

    fam = family(cfg.model.family)
    model_cfg = fam.make_config(cfg.model.sizes(vocab_size))
    with on_meta():
        model = fam.build(model_cfg)
    return model, fam.plan(model_cfg)


def adapter_shapes(cfg: TrainConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Each adapter's logical shape on the whole model (built on meta); ValueError for a
    target matching no layer or a rank above a layer's smallest dimension."""
    model, plan = _whole_model(cfg, vocab_size)
    skip = plan.last_stage
    shapes: dict[str, tuple[int, ...]] = {}
    for path, module in targeted_layers(model, cfg.lora, skip):
        a, b = (f"{path}.{n}" for n in ADAPTER_NAMES)
        shapes[a] = (cfg.lora.lora_rank, module.in_features)
        shapes[b] = (module.out_features, cfg.lora.lora_rank)
    return shapes


def check_lora(cfg: TrainConfig, vocab_size: int) -> None:
    """Before any rank starts: the targets, the rank, and ``--lora-from``'s tensors."""
    if not cfg.lora.enabled:
        return
    if cfg.lora.lora_from and cfg.model.family != "llama":
        raise ValueError(
            f"--lora-from {cfg.lora.lora_from} needs a {peft.FAMILIES} model, not a "
            f"{cfg.model.family} one (GPT-2's PEFT names differ)"
        )
    shapes = adapter_shapes(cfg, vocab_size)
    if cfg.lora.lora_from:
        peft.AdapterFile(cfg.lora.lora_from).check(shapes)
    if cfg.lora.quantize_base == "nf4":
        check_nf4_rows(cfg, vocab_size)


def check_nf4_rows(cfg: TrainConfig, vocab_size: int) -> None:
    """Each rank's row of every quantised weight is whole 64-value blocks (a row-parallel
    layer holds in_features / tp of each row), so no block straddles a tp shard."""
    model, plan = _whole_model(cfg, vocab_size)
    rows = {}  # path -> (in_features, split by tp)
    for path, module in model.named_modules():
        if isinstance(module, LINEAR_TYPES) and path not in plan.last_stage:
            rows[path] = (module.in_features, plan.tp_style(path) == "rowwise")

    def row_on_rank(n: int, split: bool, tp: int) -> int:
        return n // tp if split else n

    def misfit(tp: int) -> str | None:
        """The first layer whose row on a rank is not whole blocks under ``tp``."""
        return next(
            (p for p, (n, split) in rows.items() if row_on_rank(n, split, tp) % BLOCK_SIZE),
            None,
        )

    tp = cfg.parallel.tp
    path = misfit(tp)
    if path is None:
        return
    n, split = rows[path]
    valid = [t for t in range(1, tp + 1) if tp % t == 0 and misfit(t) is None]
    held = f"{n} / tp {tp} = {row_on_rank(n, split, tp)}" if split else str(n)
    layout = f" --tp {tp}" if tp > 1 else ""
    raise ValueError(
        f"--quantize-base nf4{layout}: a row of {path} holds {held} values per rank, not "
        f"whole {BLOCK_SIZE}-value NF4 blocks; valid: "
        + (f"--tp {', '.join(map(str, valid))}" if valid else "--quantize-base none")
    )


def lora_values(parallel_model, values, cfg: TrainConfig, dtype, device):
    """The engines' values with the adapters' (drawn, or ``--lora-from``'s); the frozen
    weights no engine holds given theirs on ``device`` in ``dtype``: all of them at ZeRO
    0-2, the experts' only at ZeRO-3, which shards the rest."""
    lora = cfg.lora
    read = peft.AdapterFile(lora.lora_from).read if lora.lora_from else None
    values = with_adapter_values(parallel_model, values, lora, cfg.data.seed, read)
    if lora.quantize_base == "nf4":  # before hold_frozen: no dense copy of these is made
        quantize_frozen(parallel_model, values, dtype, device, parallel_model.plan.last_stage)
    experts_only = (lambda p: ep_split(p) is not None) if cfg.parallel.zero == 3 else None
    hold_frozen(parallel_model, values, dtype, device, experts_only)
    return values
