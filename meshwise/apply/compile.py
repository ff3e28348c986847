"""``torch.compile`` applied per transformer block from outside the model (as torchtitan
compiles each block): the compiled region holds compute only. Modules that issue
collectives (tensor-parallel layers, ring attention, expert all-to-all), read the host
(MoE's token counts) or defer weight gradients (zero-bubble's split backward) run eager,
and the block's largest parts without them compile whole, with ``fullgraph=True``: a
graph break is an error, never a silent fallback. Each compiled module stays the same
object, its class swapped (as activation checkpointing does), so parameter names carry
no ``_orig_mod.`` and the engines' module hooks run outside the compiled code.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from meshwise.apply.experts import ExpertParallelExperts
from meshwise.context_parallel.ring import RingAttention
from meshwise.models.moe import Experts
from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardRMSNorm
from meshwise.tensor_parallel.mappings import tp_size_of
from meshwise.tensor_parallel.sequence import SequenceParallelEmbedding
from meshwise.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
)

if TYPE_CHECKING:
    from meshwise.apply.parallelize import ParallelModel

# Their forwards issue collectives or read the host: they run eager, by design.
_EAGER = (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardRMSNorm,
    SequenceParallelEmbedding,
    VocabParallelEmbedding,
    VocabParallelHead,
    RingAttention,
    ExpertParallelExperts,
    Experts,
)
# One kernel each: compiling one alone buys nothing and costs a graph.
_SINGLE_KERNEL = (nn.Linear, nn.Embedding)
# torch.compile's backend. Tests of tracing alone (graph breaks, hooks, recompiles) may
# set "aot_eager": dynamo and AOTAutograd as inductor gets them, without its codegen.
BACKEND = "inductor"


def compile_blocks(blocks: Iterable[nn.Module], split_backward: bool = False) -> list[str]:
    """Compile each of ``blocks`` (a model's or this rank's chunks' layers), or where a
    block holds eager modules (``_EAGER``; with ``split_backward`` every ``nn.Linear``
    too, whose weight gradient waits for a W action), its largest parts without them.
    Apply it after the plan and before activation checkpointing, so checkpointing wraps
    the compiled forward. Returns the names of the classes compiled."""
    if isinstance(blocks, nn.ModuleDict):
        blocks = blocks.values()
    eager = _EAGER + ((nn.Linear,) if split_backward else ())
    compiled: list[str] = []
    for block in blocks:
        for module in _compute_parts(block, eager):
            if not isinstance(module, Compiled):
                module.__class__ = _compiled_class(type(module), BACKEND)
            name = type(module).__mro__[2].__name__
            if name not in compiled:
                compiled.append(name)
    return compiled


def compile_loss(parallel_model: ParallelModel) -> list[str]:
    """Compile the last stage's final norm (as a block's parts) and, at tp 1, the cross
    entropy over the logits, one fullgraph region from the head's output to the summed
    loss. Under tp the vocab-parallel loss all-reduces its maxima and sums: it stays
    eager. Returns the names compiled ("cross_entropy" for the loss)."""
    ends = [parallel_model.end_modules(chunk)[1] for chunk in parallel_model.chunks]
    compiled = compile_blocks(m for modules in ends for m in modules)
    if tp_size_of(parallel_model.tp_group) == 1:
        parallel_model.compiled_loss = _compiled_loss(BACKEND)
        compiled.append("cross_entropy")
    return compiled


def _token_loss_sum(logits: torch.Tensor, targets: torch.Tensor, vocab_size: int | None):
    # The eager loss's own code at tp 1 (fp32 cast, padded columns cut, cross entropy):
    # compiled, its softmax and gather fuse instead of writing fp32 logits twice.
    return vocab_parallel_cross_entropy(logits, targets, None, vocab_size, reduction="sum")


_COMPILED_LOSSES: dict[str, Callable[..., torch.Tensor]] = {}


def _compiled_loss(backend: str) -> Callable[..., torch.Tensor]:
    if backend not in _COMPILED_LOSSES:
        _COMPILED_LOSSES[backend] = torch.compile(
            _token_loss_sum, fullgraph=True, dynamic=False, backend=backend
        )
    return _COMPILED_LOSSES[backend]


def _compute_parts(module: nn.Module, eager: tuple[type, ...]) -> list[nn.Module]:
    """The largest submodules of ``module`` (itself included) holding no eager module."""
    if isinstance(module, eager):
        return []
    if not any(isinstance(m, eager) for m in module.modules()):
        return [] if type(module) in _SINGLE_KERNEL else [module]
    return [part for child in module.children() for part in _compute_parts(child, eager)]


class Compiled:
    """Put in front of a module's class: its forward runs compiled (one compiled function
    per class, shared by every block of it: the module is an input, not a constant)."""

    _compiled_forward: staticmethod

    def forward(self, *args, **kwargs):
        return self._compiled_forward(self, *args, **kwargs)


_COMPILED_CLASSES: dict[tuple[type[nn.Module], str], type] = {}


def _compiled_class(cls: type[nn.Module], backend: str) -> type:
    """One compiled subclass per (class, backend), made once."""
    key = (cls, backend)
    if key not in _COMPILED_CLASSES:
        _COMPILED_CLASSES[key] = _make_compiled_class(cls, backend)
    return _COMPILED_CLASSES[key]


def _make_compiled_class(cls: type[nn.Module], backend: str) -> type:
    # Static shapes: a new shape (an epoch's short last batch) compiles once more rather
    # than turning every size symbolic, which the attention kernels' choices cannot take.
    forward = torch.compile(cls.forward, fullgraph=True, dynamic=False, backend=backend)
    return type(
        f"Compiled{cls.__name__}", (Compiled, cls), {"_compiled_forward": staticmethod(forward)}
    )


def keep_kernels_in(cache_dir: str | None) -> None:
    """Keep inductor's compiled kernels under meshwise's cache (``--cache-dir``, else
    $MESHWISE_CACHE or ~/.cache/meshwise, then ``inductor``), so a later run of the same
    blocks and shapes finds them; a TORCHINDUCTOR_CACHE_DIR already set wins."""
    from meshwise.data.sources import default_cache_dir

    root = Path(cache_dir) if cache_dir else default_cache_dir()
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(root / "inductor"))


def compile_seconds() -> float:
    """Seconds this process has spent compiling so far: dynamo with the forward graphs,
    and the backward graphs, which AOTAutograd compiles at their first backward."""
    if "torch._dynamo" not in sys.modules:  # nothing compiled; importing it costs seconds
        return 0.0
    metrics = getattr(torch._dynamo.utils, "compilation_time_metrics", {})
    keys = ("_compile.compile_inner", "compile_fx.<locals>.bw_compiler")
    return float(sum(sum(metrics.get(key, ())) for key in keys))


def compiler_problem(device_type: str) -> str:
    """Why ``torch.compile`` cannot serve on ``device_type`` here, or "" if it can."""
    import torch._dynamo

    if not torch._dynamo.is_dynamo_supported():
        return (
            f"--compile: torch {torch.__version__}'s compiler does not run on this Python "
            "(dynamo unsupported); valid: drop --compile, or a Python torch compiles on"
        )
    if device_type == "cpu":
        from torch._inductor import cpp_builder

        try:
            cpp_builder.get_cpp_compiler()
        except Exception as exc:  # inductor names the compilers it looked for
            return (
                f"--compile on the CPU needs a C++ compiler for inductor, none found ({exc}); "
                "valid: install g++ or clang (or set CXX), or drop --compile"
            )
    return ""
