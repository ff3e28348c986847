"""The flags of ``meshwise train``, their TOML form, and where each value came from.

One table (``TRAIN_FLAGS``, in ``meshwise.cli.train_flag_table``) drives the parser, the TOML
reader and the help; defaults live only in ``meshwise.train.config``'s dataclasses. A new
setting: a field with its default, its check in ``TrainConfig.validate``, a row in the table
and one in docs/flags.md (tested).
"""

from __future__ import annotations

import argparse
import dataclasses

from meshwise.cli.train_flag_table import TRAIN_FLAGS
from meshwise.train.config import TrainConfig

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
