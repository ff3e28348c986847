"""What ``parallelize`` checks first, so a plan cannot be silently wrong: names and styles,
ties, split sizes, the vocabulary, and the forward on meta copies of a tp shard and of
each stage (docs/own-model.md).
"""

from __future__ import annotations

import copy
from typing import Callable

import torch
from torch import nn

from meshwise.geometry.errors import MeshwiseError
from meshwise.geometry.init import on_meta
from meshwise.geometry.plan import ParallelPlan
from meshwise.tensor_parallel.layers import padded_vocab_size

_FITS = {
    "colwise": nn.Linear,
    "rowwise": nn.Linear,
    "vocab_head": nn.Linear,
    "vocab_embedding": nn.Embedding,
    "position_embedding": nn.Embedding,
}
_RESHAPE_RULE = (
    "where a split dimension is reshaped, use -1 or the local size "
    "(view(B, T, -1, head_dim)), not the whole model's count of heads or features"
)


def split_modules(model: nn.Module, plan: ParallelPlan) -> list[tuple[str, nn.Module, str]]:
    """``(path, module, style)`` of every module the plan splits; ValueError for a
    pattern that matches nothing or a style that does not fit the module's type."""
    found, used = [], set()
    for path, module in model.named_modules():
        match = plan.tp_match(path)
        if match is None:
            continue
        pattern, style = match
        if style == "shard_norm":
            weight = getattr(module, "weight", None)
            if not hasattr(module, "eps") or weight is None or weight.dim() != 1:
                raise MeshwiseError(
                    f"plan: {path} is a {type(module).__name__}, but style "
                    "'shard_norm' needs an RMSNorm (a weight of one dim and eps)"
                )
        elif not isinstance(module, _FITS[style]):
            raise MeshwiseError(
                f"plan: {path} is a {type(module).__name__}, but style {style!r} "
                f"needs an nn.{_FITS[style].__name__}; change its style or the "
                "module"
            )
        used.add(pattern)
        found.append((path, module, style))
    for pattern, _ in plan.tp:
        if pattern not in used:
            raise MeshwiseError(
                f"plan: tp pattern {pattern!r} matches no module of "
                f"{type(model).__name__}; fix the name (modules look like "
                f"{_examples(model)})"
            )
    return found


def _examples(model: nn.Module) -> str:
    names = [n for n, _ in model.named_modules() if n][:6]
    return ", ".join(names) or "none"


def check_names(model: nn.Module, plan: ParallelPlan) -> None:
    """The end modules and tied parameters named by the plan exist; ties share one shape."""
    modules = dict(model.named_modules())
    for name in (*plan.first_stage, *plan.last_stage):
        if name not in modules:
            raise MeshwiseError(
                f"plan: first_stage/last_stage module {name!r} is not a module of "
                f"{type(model).__name__}; fix the name (modules look like "
                f"{_examples(model)})"
            )
    params = dict(model.named_parameters(remove_duplicate=False))
    for tie in plan.ties:
        for name in tie:
            if name not in params:
                raise MeshwiseError(
                    f"plan: tied parameter {name!r} is not a parameter of "
                    f"{type(model).__name__}; fix the name"
                )
        shapes = {name: tuple(params[name].shape) for name in tie}
        if len(set(shapes.values())) > 1:
            raise MeshwiseError(
                f"plan: tied parameters have different shapes {shapes}; tie "
                "only parameters of one shape (an embedding (V, D) and a head "
                "nn.Linear(D, V))"
            )


def check_divisible(split, tp_size: int) -> None:
    for path, module, style in split:
        if style in ("colwise", "rowwise"):
            attr = "out_features" if style == "colwise" else "in_features"
            size = getattr(module, attr)
            if size % tp_size:
                raise MeshwiseError(
                    f"plan: {path}.{attr} = {size} is not divisible by tp "
                    f"{tp_size}; choose a tp that divides it, or replicate {path}"
                )


def vocab_from_modules(split, given: int | None) -> int | None:
    """The vocabulary of the modules split over it (``vocab_embedding``/``vocab_head``)."""
    sizes = {
        path: (m.num_embeddings if style == "vocab_embedding" else m.out_features)
        for path, m, style in split
        if style in ("vocab_embedding", "vocab_head")
    }
    if len(set(sizes.values())) > 1:
        raise MeshwiseError(
            f"plan: the vocabulary-split modules disagree on the vocabulary: "
            f"{sizes}; give them one size"
        )
    found = next(iter(sizes.values()), None)
    if given is not None and found is not None and given != found:
        raise MeshwiseError(
            f"vocab_size={given} but {next(iter(sizes))} holds {found} rows; "
            "leave vocab_size out (it is read from the model) or make them agree"
        )
    return found if found is not None else given


def check_forward(
    model: nn.Module,
    split,
    tp_size: int,
    num_stages: int,
    cut: Callable[[nn.Module, int, int], nn.Module],
) -> None:
    """Run the model's forward on meta copies: shrunk to one tp rank's shard, and cut
    into pipeline stages. Skipped if the model is not on the meta device or its
    whole forward does not take a ``(batch, tokens)`` tensor of ids."""
    if any(p.device.type != "meta" for p in model.parameters()):
        return  # a model that holds values: a copy would cost memory (checked on meta)
    tokens = torch.zeros(1, 2, dtype=torch.long, device="meta")
    try:
        with torch.no_grad():
            copy.deepcopy(model)(tokens)
    except Exception:  # another input convention, or code meta cannot run: no check
        return
    if tp_size > 1:
        shard = _shrunk(model, split, tp_size)
        _run(
            shard,
            tokens,
            lambda where, exc: (
                f"plan: {where}'s forward fails on one tensor-parallel shard (tp {tp_size}): "
                f"{_first_line(exc)}; {_RESHAPE_RULE}"
            ),
        )
    if num_stages > 1:
        x = tokens
        for stage in range(num_stages):
            x = _run(
                cut(copy.deepcopy(model), stage, num_stages), x, _stage_failure(stage, num_stages)
            )


def _stage_failure(stage: int, num_stages: int) -> Callable[[str, Exception], str]:
    return lambda where, exc: (
        f"plan: {where}'s forward fails in pipeline stage {stage} of {num_stages}, "
        f"where the modules a stage does not hold are None: {_first_line(exc)}; the "
        "forward must skip a module set to None (if self.head is not None: ...) and "
        "take the previous stage's output in place of the token ids"
    )


def _shrunk(model: nn.Module, split, tp_size: int) -> nn.Module:
    shard = copy.deepcopy(model)
    for path, module, style in split:
        if style in ("shard_norm", "position_embedding"):  # the same shape on every rank
            continue
        bias = getattr(module, "bias", None) is not None
        new: nn.Module
        with on_meta():
            if style == "colwise":
                new = nn.Linear(module.in_features, module.out_features // tp_size, bias)
            elif style == "rowwise":
                new = nn.Linear(module.in_features // tp_size, module.out_features, bias)
            elif style == "vocab_head":
                rows = padded_vocab_size(module.out_features, tp_size) // tp_size
                new = nn.Linear(module.in_features, rows, bias)
            else:
                rows = padded_vocab_size(module.num_embeddings, tp_size) // tp_size
                new = nn.Embedding(rows, module.embedding_dim)
        parent, _, attr = path.rpartition(".")
        setattr(shard.get_submodule(parent) if parent else shard, attr, new)
    return shard


def _run(model: nn.Module, x, message: Callable[[str, Exception], str]):
    """``model(x)`` on meta; an error is raised again with the innermost running module."""
    stack: list[str] = []
    names = {id(m): (n or type(model).__name__) for n, m in model.named_modules()}
    hooks = []

    def enter(module, args) -> None:  # a hook returning a value would replace the input
        stack.append(names[id(module)])

    def leave(module, args, out) -> None:
        stack.pop()

    for module in model.modules():
        hooks.append(module.register_forward_pre_hook(enter))
        hooks.append(module.register_forward_hook(leave))
    try:
        with torch.no_grad():
            return model(x)
    except Exception as exc:
        where = stack[-1] if stack else type(model).__name__
        raise MeshwiseError(message(where, exc)) from exc
    finally:
        for hook in hooks:
            hook.remove()


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
