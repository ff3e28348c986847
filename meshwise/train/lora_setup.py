"""LoRA in a run: ``--lora-from``'s settings (reading flags), the checks before any rank
starts (targets, rank, the adapter's tensors), and each rank's values of the adapters and
of the frozen weights they sit beside.
"""

from __future__ import annotations

from meshwise.apply.lora import ADAPTER_NAMES, hold_frozen, targeted_layers, with_adapter_values
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


def adapter_shapes(cfg: TrainConfig, vocab_size: int) -> dict[str, tuple[int, ...]]:
    """Each adapter's logical shape on the whole model (built on meta); ValueError for a
    target matching no layer or a rank above a layer's smallest dimension."""
    from meshwise.models.families import family

    fam = family(cfg.model.family)
    model_cfg = fam.make_config(cfg.model.sizes(vocab_size))
    with on_meta():
        model = fam.build(model_cfg)
    skip = fam.plan(model_cfg).last_stage
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


def lora_values(parallel_model, values, cfg: TrainConfig, dtype, device):
    """The engines' values with the adapters' (drawn, or ``--lora-from``'s); the frozen
    weights no engine holds given theirs on ``device`` in ``dtype``: all of them at ZeRO
    0-2, the experts' only at ZeRO-3, which shards the rest."""
    lora = cfg.lora
    read = peft.AdapterFile(lora.lora_from).read if lora.lora_from else None
    values = with_adapter_values(parallel_model, values, lora, cfg.data.seed, read)
    experts_only = (lambda p: ep_split(p) is not None) if cfg.parallel.zero == 3 else None
    hold_frozen(parallel_model, values, dtype, device, experts_only)
    return values
