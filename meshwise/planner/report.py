"""What ``meshwise plan`` prints: the ranked table, and one layout's breakdown."""

from __future__ import annotations

from meshwise.apply.lora import ALL_LINEAR
from meshwise.planner.hybrid import why
from meshwise.planner.layout import Layout
from meshwise.planner.search import Prediction

MIB, GIB = 2**20, 2**30


def _bytes(n: float) -> str:
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.0f} MiB"


def _seconds(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms"


def header(request) -> list[str]:
    cfg, shape, device = request.cfg, request.shape, request.device
    m = cfg.model.resolved()
    where = (
        f"{device.memory_bytes / GIB:.1f} GiB machine, {request.limit / GIB:.2f} GiB per rank"
        if device.memory_per_node
        else f"{request.limit / GIB:.1f} GiB per device"
    )
    nodes = (
        f", {request.world // device.ranks_per_node} node(s) of {device.ranks_per_node}"
        if device.ranks_per_node > 0
        else ""
    )
    cores = f", {device.cores} cores" if device.cores else ""
    experts = (
        f" ({shape.active_params / 1e6:,.1f}M active: {shape.moe_layers} MoE layers of "
        f"{shape.n_experts} experts, top-{shape.experts_per_token})"
        if shape.n_experts
        else ""
    )
    return [
        f"model {m.preset if not m.init_from else m.init_from}: {shape.num_params / 1e6:,.1f}M "
        f"parameters{experts}, {shape.n_layer} layers, d_model {shape.d_model}; global batch "
        f"{cfg.data.batch_size} x {cfg.data.seq_len} tokens, {cfg.runtime.dtype}{_lora(request)}",
        f"world {request.world} on {device.name} ({where}{nodes}{cores}); {device.source}",
    ]


def _lora(request) -> str:
    """The LoRA fine-tune planned, if any: what trains and how the base is held."""
    lora, shape = request.shape.lora, request.shape
    if lora is None:
        return ""
    adapters = shape.n_layer * (lora.adapter_split + lora.adapter_replicated) + lora.adapter_root
    held = " (linear weights NF4)" if lora.quantized else ""
    return (
        f"; LoRA rank {lora.rank} on {request.cfg.lora.lora_targets}: {adapters / 1e6:,.2f}M "
        f"adapter parameters trained, the rest frozen{held}"
    )


def table(request, results: list[Prediction], top: int) -> str:
    """The best ``top`` layouts, one line each, with where memory and time go."""
    lines = header(request)
    lines.append(
        f"{len(results)} valid layouts fit; the best {min(top, len(results))}, "
        "by predicted tokens/s:"
    )
    width = max([len(p.layout.flags()) for p in results[:top]] + [6])
    lines.append(
        f"{'#':>3}  {'layout':<{width}} {'peak mem':>10} {'step':>9} {'tokens/s':>10} "
        f"{'MFU':>6}  {'compute':>7} {'bubble':>6} {'comm':>6} {'optim':>6}"
    )
    for i, p in enumerate(results[:top], 1):
        t = p.time
        comm = t.tp + t.cp + t.ep + t.dp
        share = [100 * x / t.step for x in (t.compute, t.bubble, comm, t.optimizer)]
        lines.append(
            f"{i:>3}  {p.layout.flags():<{width}} {_bytes(p.memory.total):>10} "
            f"{_seconds(t.step):>9} {p.tokens_per_s:>10,.0f} {100 * p.mfu:>5.1f}%  "
            + " ".join(f"{s:>6.0f}%" for s in share)
        )
    if results and results[0].layout.replicas > 1:
        lines.append(f"hybrid sharding, {why(results[0].layout)}")
    if results:
        lines.append(
            f"run the best: meshwise train {results[0].layout.flags()} "
            f"--seq-len {request.cfg.data.seq_len} --batch-size "
            f"{request.cfg.data.batch_size}{planned_as(request.cfg)} ...; "
            "--explain LAYOUT for a breakdown"
        )
    return "\n".join(lines)


def planned_as(cfg) -> str:
    """The flags beside the layout that the plan priced (compilation, LoRA), each with a
    leading space, for the command it suggests."""
    flags = []
    if cfg.runtime.compile:
        flags.append("--compile")
    lora = cfg.lora
    if lora.enabled:
        flags.append(f"--lora-rank {lora.lora_rank}")
        if lora.lora_targets != ALL_LINEAR:
            flags.append(f"--lora-targets {lora.lora_targets}")
        if lora.quantize_base != "none":
            flags.append(f"--quantize-base {lora.quantize_base}")
    return "".join(f" {f}" for f in flags)


def explain(request, layout: Layout) -> str:
    """Where one layout's memory and time go (the worst rank)."""
    p = request.predict(layout)
    m, t = p.memory, p.time
    lines = header(request)
    lines.append(f"layout: {layout.flags()}")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(
        f"peak memory {_bytes(m.total)} on pipeline rank {m.rank} ({verdict} in "
        f"{_bytes(request.limit)}); {m.params / 1e6:,.2f}M parameters there, "
        f"{m.in_flight} micro-batch(es) of activations kept at once"
    )
    for name, value in m.parts().items():
        lines.append(f"  {name:<18} {_bytes(value):>10}  {100 * value / m.total:5.1f}%")
    lines.append(
        f"step time {_seconds(t.step)}: {p.tokens_per_s:,.0f} tokens/s, MFU "
        f"{100 * p.mfu:.1f}%, pipeline bubble {100 * t.bubble_fraction:.1f}%"
    )
    for name, value in t.parts().items():
        lines.append(f"  {name:<18} {_seconds(value):>10}  {100 * value / t.step:5.1f}%")
    if layout.replicas > 1:
        lines.append(why(layout))
    if layout.ep > 1 and request.shape.moe_layers:
        lines.append(_all_to_all_line(request, layout))
    return "\n".join(lines)


def _all_to_all_line(request, layout: Layout) -> str:
    """The experts' all-to-all bytes a rank sends per MoE layer and micro-batch."""
    from meshwise.planner.compute import micro_batch_tokens
    from meshwise.planner.experts import all_to_all_bytes
    from meshwise.planner.memory import DTYPE_BYTES
    from meshwise.planner.search import settings_of

    st, shape = settings_of(request.cfg, request.device), request.shape
    tokens = micro_batch_tokens(layout, st)
    recompute = layout.activation_checkpointing != "none"
    nbytes = all_to_all_bytes(
        tokens, shape.experts_per_token, shape.d_model, DTYPE_BYTES[st.dtype], layout.ep, recompute
    )
    return (
        f"all-to-all {_bytes(nbytes)} sent per rank, MoE layer and micro-batch of {tokens} "
        f"tokens ({4 + 2 * recompute} x tokens x top-{shape.experts_per_token} x d_model "
        f"{shape.d_model} x {DTYPE_BYTES[st.dtype]} B x (ep - 1) / ep)"
    )
