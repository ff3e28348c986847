"""Apply a ``ParallelPlan`` to a plain model built on the meta device, in torchtitan's order:
the pipeline cut, then tensor and context parallelism per chunk (activation
checkpointing and sharding are the caller's); engines fill their buffers from
``ParallelModel.init_values``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from meshwise.apply.checks import (
    check_divisible,
    check_forward,
    check_names,
    split_modules,
    vocab_from_modules,
)
from meshwise.apply.experts import ExpertParallelExperts
from meshwise.apply.module_init import default_inits
from meshwise.apply.stages import chunk_layers, cut_stage, layers_of, set_module
from meshwise.comm import ops
from meshwise.context_parallel.ring import RingAttention
from meshwise.geometry.errors import MeshwiseError
from meshwise.geometry.init import Init, init_values
from meshwise.geometry.params import logical_piece, mark_tie
from meshwise.geometry.pieces import Piece
from meshwise.geometry.plan import ParallelPlan
from meshwise.models.attention import Positions
from meshwise.models.moe import Experts
from meshwise.pipeline.actions import stage_index
from meshwise.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear, ShardRMSNorm
from meshwise.tensor_parallel.mappings import tp_rank_of, tp_size_of
from meshwise.tensor_parallel.sequence import SequenceGather, SequenceParallelEmbedding
from meshwise.tensor_parallel.vocab import (
    VocabParallelEmbedding,
    VocabParallelHead,
    vocab_parallel_cross_entropy,
)

# Each style's parallel form: (module, tp_group, sequence) -> module, where
# ``sequence`` is the chunk's ``SequenceGather`` under sequence parallelism, else None.
_SWAP: dict[str, Callable[..., nn.Module]] = {
    "colwise": ColumnParallelLinear.from_linear,
    "rowwise": RowParallelLinear.from_linear,
    "vocab_embedding": VocabParallelEmbedding.from_embedding,
    "vocab_head": VocabParallelHead.from_linear,
    "shard_norm": ShardRMSNorm.from_norm,
    "position_embedding": SequenceParallelEmbedding.from_embedding,
}
_CP_SWAP = {
    "positions": Positions.for_cp,
    "ring_attention": RingAttention.from_sdpa,
}


@dataclass
class ParallelModel:
    """This rank's part of a model laid out by a plan.

    ``chunks``: one module per virtual stage held here (``stages``: their logical indices),
    named as the single-process model. ``cross_stage_ties``: members whose partners live on
    another rank; ``local_ties``: members held here in different chunks (a V's ends).
    ``sequence_parallel``: every tp-replicated parameter's gradient is a partial sum over tp.
    ``ep_group``: the ranks the experts are split over (None: not split).
    """

    chunks: list[nn.Module]
    stages: list[int]
    num_stages: int
    plan: ParallelPlan
    tp_group: ops.Group | None
    vocab_size: int | None
    cross_stage_ties: list[str] = field(default_factory=list)
    local_ties: list[tuple[str, ...]] = field(default_factory=list)
    sequence_parallel: bool = False
    # each logical parameter's own initialisation (its module's), or why there is none
    own_inits: dict[str, Init] | None = None
    own_inits_problem: str = ""
    ep_group: ops.Group | None = None  # the experts are split over it (None: not split)
    # --compile at tp 1: the loss's compiled form, (logits, targets, vocab_size) -> sum
    compiled_loss: Callable[..., torch.Tensor] | None = None

    @property
    def holds_last_stage(self) -> bool:
        return self.num_stages - 1 in self.stages

    def end_modules(self, chunk: nn.Module) -> tuple[list[nn.Module], list[nn.Module]]:
        """The plan's first-stage and last-stage modules this chunk holds, with parameters
        (each its own ZeRO-3 unit: a tied embedding must not share its shards)."""

        def held(names):
            found = []
            for name in names:
                try:
                    module = chunk.get_submodule(name)
                except AttributeError:
                    continue
                if module is not None and next(module.parameters(), None) is not None:
                    found.append(module)
            return found

        return held(self.plan.first_stage), held(self.plan.last_stage)

    def named_parameters(self) -> list[tuple[str, nn.Parameter]]:
        """Every parameter of every chunk, each once, under its single-process name."""
        seen, out = set(), []
        for chunk in self.chunks:
            for name, p in chunk.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    out.append((name, p))
        return out

    def layers(self) -> list[nn.Module]:
        """The repeated layers of every chunk, in order (ZeRO-3 units, checkpointing)."""
        return [layer for chunk in self.chunks for layer in chunk_layers(chunk, self.plan)]

    def logical_name(self, name: str) -> str:
        return self.plan.logical_name(name)

    def is_writer(self, name: str) -> bool:
        """Whether this parameter is its tensor's stored copy (a tie's other member
        is a copy of the first, on another stage)."""
        return self.logical_name(name) == name

    def pieces(self, named_params=None) -> dict[str, Piece]:
        """Each parameter's box inside its logical tensor (what a checkpoint stores).

        ``named_params``: the parameters as they were before an engine took them
        (default: the chunks' own, which ZeRO-3 unregisters)."""
        rank, size = tp_rank_of(self.tp_group), tp_size_of(self.tp_group)
        named = self.named_parameters() if named_params is None else named_params
        return {name: logical_piece(self.logical_name(name), p, rank, size) for name, p in named}

    def init_values(self, init_of: Callable[[str], Init] | None = None, seed: int = 0):
        """``values(name, start, end)`` for the engines: the single-process initial
        values of this rank's slice, drawn for only the elements asked for.

        ``init_of(logical name) -> Init``; ``None``: each parameter's own module's
        initialisation (``meshwise.apply.module_init``)."""
        if init_of is None:
            if self.own_inits is None:
                raise MeshwiseError(self.own_inits_problem)
            init_of = self.own_init
        return self.values_from(lambda piece: init_values(init_of(piece.name), seed, piece))

    def own_init(self, name: str) -> Init:
        """The initialisation parameter ``name``'s module gives it (ValueError if unknown)."""
        if self.own_inits is None:
            raise MeshwiseError(self.own_inits_problem)
        return self.own_inits[self.logical_name(name)]

    def values_from(self, read: Callable[[Piece], torch.Tensor]):
        """``values(name, start, end)`` for the engines from ``read(piece)``, which
        gives the elements of a piece of a logical tensor (flat, float32): elements
        ``[start, end)`` of this rank's parameter ``name`` are the piece they map to."""
        pieces = self.pieces()

        def values(name: str, start: int, end: int) -> torch.Tensor:
            piece = pieces[name]
            if end <= piece.numel:  # no padding: the piece's values as read, not a copy
                return read(piece.flat(start, end))
            out = torch.zeros(end - start)
            # Along dim 0 the real rows come first; padding (vocabulary) stays zero.
            real_end = min(end, piece.numel)
            if start < real_end:
                out[: real_end - start] = read(piece.flat(start, real_end))
            return out

        return values

    def loss(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Sum of token losses; from the logit shards under tensor parallelism."""
        if self.compiled_loss is not None:
            return self.compiled_loss(logits, targets, self.vocab_size)
        return vocab_parallel_cross_entropy(
            logits, targets, self.tp_group, vocab_size=self.vocab_size, reduction="sum"
        )

    def full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary ``(..., vocab_size)`` (for sampling)."""
        for module in self.chunks[-1].modules():
            if isinstance(module, VocabParallelHead):
                return module.full_logits(logits)
        return logits[..., : self.vocab_size]


def parallelize(
    model: nn.Module,
    plan: ParallelPlan,
    tp_group=None,
    pp_rank: int = 0,
    pp_size: int = 1,
    virtual_stages: int = 1,
    vocab_size: int | None = None,
    sequence_parallel: bool = False,
    cp_group=None,
    stage_map: str = "loop",
    *,
    mesh=None,
    tie_group=None,
    ep_group=None,
    check_forward: bool = True,
) -> ParallelModel:
    """This rank's ``ParallelModel`` of ``model`` (consumed: chunks reuse it).

    ``mesh`` gives the groups and pipeline position, or one by one: ``tp_group``,
    ``pp_rank``/``pp_size``/``virtual_stages``, ``stage_map`` (``loop`` or ``v``,
    ``meshwise.pipeline.actions``), ``sequence_parallel`` (tp > 1), ``cp_group`` (None or size
    1: none), ``tie_group`` (over which engines sum a cross-stage tie; they refuse one
    without it), ``ep_group`` (the plan's experts split over it; None or size 1: none).
    ``vocab_size``, when given, must agree with the plan's modules. The plan is
    checked first (a ``ValueError`` names the module); ``check_forward`` adds the forward on
    meta copies (a second or two: meta tensors import torch's compiler; the trainer skips it
    for the families meshwise ships).
    """
    if mesh is not None:
        tp_group = mesh.tp_group if mesh.dims.tp > 1 else None
        pp_rank, pp_size, tie_group = mesh.pp_rank, mesh.dims.pp, mesh.tie_group
        cp_group = mesh.cp_group if mesh.dims.cp > 1 else None
        ep_group = mesh.ep_group
    num_stages = pp_size * virtual_stages
    layers = layers_of(model, plan)
    if len(layers) % num_stages:
        raise MeshwiseError(
            f"{len(layers)} layers do not split into pp x virtual stages = "
            f"{pp_size} x {virtual_stages} = {num_stages} equal chunks"
        )
    if sequence_parallel and tp_size_of(tp_group) == 1:
        raise MeshwiseError(
            "sequence parallelism splits the sequence across tp ranks: it needs tp > 1"
        )
    cp_size = 1 if cp_group is None else cp_group.size
    if cp_size > 1 and not plan.ring_capable:
        raise MeshwiseError(
            f"{type(model).__name__}'s plan names no ring_attention: its "
            "attention cannot run under context parallelism"
        )
    vocab_size, own, problem = _check(
        model, plan, tp_size_of(tp_group), num_stages, vocab_size, check_forward
    )
    stages = [stage_index(pp_rank, v, pp_size, stage_map) for v in range(virtual_stages)]
    chunks = [cut_stage(model, plan, s, num_stages) for s in stages]
    for chunk in chunks:
        if tp_size_of(tp_group) > 1:
            _apply_tp(
                chunk, plan, tp_group, SequenceGather(tp_group) if sequence_parallel else None
            )
        if cp_size > 1:
            _swap_styles(
                chunk, plan.cp_style, lambda style, module: _CP_SWAP[style](module, cp_group)
            )
        if ep_group is not None and ep_group.size > 1:
            _swap_styles(
                chunk, plan.ep_style, lambda style, module: _split_experts(module, ep_group)
            )
    remote, local = _cross_stage_ties(chunks, plan, num_stages)
    _mark_ties(chunks, remote, tie_group)
    return ParallelModel(
        chunks,
        stages,
        num_stages,
        plan,
        tp_group,
        vocab_size,
        remote,
        local,
        sequence_parallel,
        own,
        problem,
        ep_group if ep_group is not None and ep_group.size > 1 else None,
    )


def _check(
    model: nn.Module,
    plan: ParallelPlan,
    tp_size: int,
    num_stages: int,
    vocab_size: int | None,
    forward: bool,
):
    """The plan against the model (before anything is cut): the vocabulary, and each
    parameter's own initialisation (or why there is none)."""
    check_names(model, plan)
    split = split_modules(model, plan)
    if tp_size > 1:
        check_divisible(split, tp_size)
    vocab_size = vocab_from_modules(split, vocab_size)
    if forward:
        check_forward(
            model, split, tp_size, num_stages, lambda m, stage, n: cut_stage(m, plan, stage, n)
        )
    try:
        return vocab_size, default_inits(model), ""
    except ValueError as exc:
        return vocab_size, None, str(exc)


def _split_experts(experts: nn.Module, ep_group) -> nn.Module:
    if not isinstance(experts, Experts):
        raise ValueError(
            f"plan: the ep style 'experts' takes an Experts module, not {type(experts).__name__}"
        )
    num_experts = experts.gate_proj.shape[0]
    if num_experts % ep_group.size:
        valid = [e for e in range(1, num_experts + 1) if num_experts % e == 0]
        raise ValueError(
            f"--ep {ep_group.size} does not divide the {num_experts} experts; "
            f"valid: {', '.join(map(str, valid))}"
        )
    return ExpertParallelExperts(experts, ep_group)


def _mark_ties(chunks, ties: list[str], tie_group) -> None:
    """Mark each cross-stage tie member with the group its gradient is summed over
    (``None``: not given; an engine then refuses the parameter)."""
    for chunk in chunks:
        params = dict(chunk.named_parameters())
        for name in ties:
            if name in params:
                mark_tie(params[name], tie_group)


def _swap_styles(chunk: nn.Module, style_of, swap) -> None:
    """Replace each module whose path has a style by ``swap(style, module)``."""
    for path, module in list(chunk.named_modules()):
        style = style_of(path)
        if style is not None:
            set_module(chunk, path, swap(style, module))


def _apply_tp(chunk: nn.Module, plan: ParallelPlan, tp_group, sequence) -> None:
    """Swap each module the plan names for its tensor-parallel form; re-tie ties.
    ``sequence``: one ``SequenceGather`` for the chunk under sequence parallelism."""
    _swap_styles(
        chunk,
        plan.tp_style,
        lambda style, module: _SWAP[style](module, tp_group, sequence=sequence),
    )
    for tie in plan.ties:
        held = [name for name in tie if _get_param(chunk, name) is not None]
        for name in held[1:]:
            first = _get_param(chunk, held[0])
            if _get_param(chunk, name).shape != first.shape:
                raise MeshwiseError(f"plan: tied {held[0]} and {name} are split differently")
            set_param(chunk, name, first)


def _cross_stage_ties(
    chunks, plan: ParallelPlan, num_stages: int
) -> tuple[list[str], list[tuple[str, ...]]]:
    """Tie members held here whose partners live on another rank, and groups of members
    held here in different chunks (separate copies, to be kept equal locally)."""
    if num_stages == 1:
        return [], []
    chunk_of = {
        name: i
        for i, chunk in enumerate(chunks)
        for name, _ in chunk.named_parameters(remove_duplicate=False)
    }
    remote, local = [], []
    for tie in plan.ties:
        held = [name for name in tie if name in chunk_of]
        if held and len(held) < len(tie):
            remote += held
        elif len({chunk_of[name] for name in held}) > 1:
            local.append(tuple(held))
    return remote, local


def _get_param(root: nn.Module, name: str):
    path, _, attr = name.rpartition(".")
    try:
        module = root.get_submodule(path) if path else root
    except AttributeError:
        return None
    return None if module is None else module._parameters.get(attr)


def set_param(root: nn.Module, name: str, param) -> None:
    """Make ``param`` the parameter ``name`` of ``root`` (how ties are made)."""
    path, _, attr = name.rpartition(".")
    (root.get_submodule(path) if path else root)._parameters[attr] = param
