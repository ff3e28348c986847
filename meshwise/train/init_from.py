"""``meshwise train --init-from DIR``: start from a local Hugging Face directory.

``apply_init_from`` (reading flags): settings and tokenizer from the directory;
``check_init_from`` (before any rank starts): the weights' headers against the config;
``initial_values`` (each rank): the values of this rank's slices only.
"""

from __future__ import annotations

from pathlib import Path

from meshwise.hf.gpt2 import SIZES as GPT2_SIZES
from meshwise.hf.gpt2 import GPT2Weights, gpt2_sizes
from meshwise.hf.llama import SIZES, llama_sizes, read_config
from meshwise.hf.llama_weights import LlamaWeights
from meshwise.train.config import MODEL_PRESETS, TrainConfig, flag_name

# config.json's model_type -> (our family, the preset whose family it is)
FAMILY_OF = {"gpt2": ("gpt", "tiny")}
LLAMA = ("llama", "llama-tiny")
# Settings config.json gives a default for that a flag may change (the flag wins).
FLAG_WINS = ("aux_loss_coef",)


def _read_sizes(where: str) -> tuple[tuple[str, str], dict, dict]:
    """(family and preset, our sizes, their config.json key of each size)."""
    config = read_config(where)
    family_preset = FAMILY_OF.get(config.get("model_type") or "", LLAMA)
    if family_preset[0] == "gpt":
        return family_preset, gpt2_sizes(config, where), GPT2_SIZES
    return family_preset, llama_sizes(config, where), SIZES


def apply_init_from(cfg: TrainConfig, origins: dict[str, str]) -> None:
    """Take the model's settings from ``--init-from``'s config.json (ValueError on a
    contradicting flag or another architecture)."""
    m = cfg.model
    if not m.init_from:
        return
    where = m.init_from
    (fam, preset), sizes, keys = _read_sizes(where)
    preset_family = MODEL_PRESETS[m.preset]["family"]
    if preset_family != fam:
        if "preset" in origins:
            valid = " or ".join(p for p, v in MODEL_PRESETS.items() if v["family"] == fam)
            raise ValueError(
                f"--model {m.preset} is a {preset_family} model but --init-from "
                f"{where} holds a {fam} model; valid: leave --model out, or "
                f"--model {valid}"
            )
        m.preset = preset  # for its family: every size below comes from config.json
        origins["preset"] = "init-from"
    for field, value in sizes.items():
        given = getattr(m, field)
        if field in FLAG_WINS and field in origins:
            continue
        if field in origins and given not in (None, 0) and given != value:
            flag = flag_name(field)
            raise ValueError(
                f"{flag} {given} contradicts --init-from {where}: its config.json "
                f"has {keys.get(field, field)} {value}; leave {flag} out"
            )
        setattr(m, field, value)
        origins.setdefault(field, "init-from")
    tokenizer = Path(where) / "tokenizer.json"
    if not cfg.data.tokenizer and tokenizer.is_file():
        cfg.data.tokenizer = str(tokenizer)
        origins["tokenizer"] = "init-from"


def check_init_from(cfg: TrainConfig) -> None:
    """Before any rank starts: every tensor is where config.json says, with its shape
    (headers only), and the tokenizer's ids fit the model's vocabulary."""
    from meshwise.data.tokenizer import load_tokenizer
    from meshwise.models.families import family

    m = cfg.model
    if not m.init_from:
        return
    model = family(m.family).make_config(m.sizes(m.vocab_size))
    if m.family == "gpt":
        weights = GPT2Weights(m.init_from, model.n_head)
        weights.files.check(weights.stored_shapes(m.sizes(m.vocab_size)))
    else:
        LlamaWeights(m.init_from, model).check()
    if cfg.data.tokenizer:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
        if tokenizer.vocab_size > model.vocab_size:
            own = Path(m.init_from, "tokenizer.json").resolve()
            valid = (
                f"--tokenizer PATH of at most {model.vocab_size} tokens, or a config.json "
                f"whose vocab_size is at least {tokenizer.vocab_size}"
                if Path(cfg.data.tokenizer).resolve() == own  # the default is what failed
                else "the model's own tokenizer (its tokenizer.json, the default)"
            )
            raise ValueError(
                f"--tokenizer {tokenizer.describe()} has more tokens than the "
                f"vocabulary of {model.vocab_size} in --init-from {m.init_from}'s "
                f"config.json; valid: {valid}"
            )


def initial_values(parallel_model, cfg: TrainConfig, init_of, seed: int):
    """The engines' ``values(name, start, end)``: the directory's weights with
    ``--init-from``, else the layout-independent initialisation of ``seed``."""
    from meshwise.models.families import family

    m = cfg.model
    if not m.init_from:
        return parallel_model.init_values(init_of, seed)
    if m.family == "gpt":
        gpt2 = GPT2Weights(m.init_from, m.resolved().n_head)
        return parallel_model.values_from(gpt2.read)
    model = family(m.family).make_config(m.sizes(m.vocab_size))
    return parallel_model.values_from(LlamaWeights(m.init_from, model).read)
