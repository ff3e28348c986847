"""Mixture-of-experts feed-forward layers, plain single-device code: a router that picks
each token's top-k experts (softmax scores as Mixtral and Qwen-MoE, or sigmoid scores
with a routing-only bias as DeepSeek-V3, arXiv 2412.19437 section 2.1.2), SwiGLU experts
held as stacked tensors, an optional shared expert (Qwen2-MoE). Dropless: every token
reaches its k experts. Expert parallelism replaces ``experts`` by a module with the same
parameters that sends tokens to the ranks holding their experts (``apply/experts.py``).
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from meshwise.models.router_stats import AUX_FORMULAS, RouterTally

ROUTER_SCORES = ("softmax", "sigmoid")


class Experts(nn.Module):
    """``num_experts`` SwiGLU experts as stacked weights: ``gate_proj[j]``, ``up_proj[j]``
    (F, D) and ``down_proj[j]`` (D, F) are expert ``j``'s ``nn.Linear`` weights."""

    def __init__(self, num_experts: int, d_model: int, ffn_hidden_size: int):
        super().__init__()
        E, D, F_ = num_experts, d_model, ffn_hidden_size
        self.gate_proj = nn.Parameter(torch.empty(E, F_, D))
        self.up_proj = nn.Parameter(torch.empty(E, F_, D))
        self.down_proj = nn.Parameter(torch.empty(E, D, F_))

    def forward(self, x: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """``x``: (N, D) tokens sorted by expert, ``counts``: (E,) tokens per expert on
        x's device."""
        return expert_swiglu(x, self.gate_proj, self.up_proj, self.down_proj, counts)


def expert_swiglu(x, gate_proj, up_proj, down_proj, counts, split_sizes=None) -> torch.Tensor:
    """Each expert's SwiGLU on its run of ``x`` (sorted by expert), (N, D) -> (N, D).

    Grouped matrix multiplies (``torch._grouped_mm``, one kernel for all experts, offsets
    read on the device, so no host sync) where they run: measured on this 2-core CPU
    (fp32, forward + backward, 8 experts), 21 ms against the per-expert loop's 600 ms at
    1024 tokens x 128 x 256, 538 ms against 829 ms at 8192 x 512 x 1024: the loop pays
    a host read of the counts and one small kernel per expert. The loop stays for widths
    whose rows are not 16-byte aligned (the grouped kernel's backward refuses them) and
    for builds without the kernel.
    """
    if _grouped_ok(x, gate_proj):
        offsets = counts.cumsum(0).to(torch.int32)  # (E,) end of each expert's run
        gate = torch._grouped_mm(x, gate_proj.transpose(-2, -1), offs=offsets)  # (N, F)
        up = torch._grouped_mm(x, up_proj.transpose(-2, -1), offs=offsets)  # (N, F)
        hidden = F.silu(gate) * up
        return torch._grouped_mm(hidden, down_proj.transpose(-2, -1), offs=offsets)  # (N, D)
    if split_sizes is None:
        split_sizes = counts.tolist()  # the loop's one host read
    outs = [
        F.linear(F.silu(F.linear(xs, gate_proj[j])) * F.linear(xs, up_proj[j]), down_proj[j])
        for j, xs in enumerate(x.split(split_sizes))
    ]
    return torch.cat(outs) if outs else x.new_zeros(0, down_proj.shape[1])


def _grouped_ok(x: torch.Tensor, gate_proj: torch.Tensor) -> bool:
    align = 16 // x.element_size()  # the kernel wants 16-byte aligned rows
    _, width, d_model = gate_proj.shape
    # CUDA's kernel takes bf16 (the default there); fp32 on CUDA takes the loop.
    dtypes = (torch.float32, torch.bfloat16) if x.device.type == "cpu" else (torch.bfloat16,)
    return (
        hasattr(torch, "_grouped_mm")
        and x.dtype in dtypes
        and width % align == 0
        and d_model % align == 0
        and gate_proj.shape[0] > 0
    )


class MoE(nn.Module):
    """Routed experts (plus an optional shared expert) in place of a decoder layer's MLP.

    ``cfg``: a ``LlamaConfig`` with ``n_experts > 0``; ``layer``: the decoder layer's
    index (the key of its router statistics); ``shared_expert``: the dense MLP module of
    the shared expert's width, built by the model (None: no shared expert).
    """

    def __init__(self, cfg, layer: int, shared_expert: nn.Module | None = None):
        super().__init__()
        self.layer = layer
        self.num_experts, self.top_k = cfg.n_experts, cfg.experts_per_token
        self.score, self.norm_topk_prob = cfg.router_score, cfg.norm_topk_prob
        self.gate = nn.Linear(cfg.d_model, cfg.n_experts, bias=False)
        width = cfg.moe_ffn_hidden_size or cfg.ffn_hidden_size
        self.experts = Experts(cfg.n_experts, cfg.d_model, width)
        if shared_expert is not None:
            self.shared_expert = shared_expert
            if cfg.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(cfg.d_model, 1, bias=False)
        if cfg.router_score == "sigmoid" or cfg.bias_update_rate > 0:
            # Moved by the load after each step, never by gradients (DeepSeek-V3's
            # auxiliary-loss-free balancing). A parameter so that every engine holds,
            # shards and checkpoints it; its gradient is exactly zero (``route``), so
            # AdamW leaves it (a vector: no weight decay), with no parameter left out.
            self.expert_bias = nn.Parameter(torch.zeros(cfg.n_experts))

    def route(self, x: torch.Tensor):
        """``x``: (N, D). Returns the chosen experts (N, k), their weights (N, k) and
        every expert's probability (N, E), all in fp32 (as transformers routes)."""
        logits = self.gate(x).float()  # (N, E)
        scores = logits.softmax(-1) if self.score == "softmax" else logits.sigmoid()
        bias = getattr(self, "expert_bias", None)
        choice = scores if bias is None else scores + bias.float()
        experts = choice.topk(self.top_k, dim=-1).indices  # (N, k)
        weights = scores.gather(-1, experts)  # (N, k): from the scores alone
        if self.norm_topk_prob:
            weights = weights / weights.sum(-1, keepdim=True)
        if bias is not None:  # its zero gradient (the choice carries none)
            weights = weights + bias.sum() * 0.0
        probs = scores if self.score == "softmax" else scores / scores.sum(-1, keepdim=True)
        return experts, weights, probs

    def forward(self, x: torch.Tensor, tally: RouterTally | None = None) -> torch.Tensor:
        """``x``: (B, T, D); ``tally``: where this forward's router statistics go (and
        the balancing loss's gradient comes from), or None."""
        B, T, D = x.shape
        tokens = x.reshape(B * T, D)  # (N, D)
        experts, weights, probs = self.route(tokens)
        flat = experts.reshape(-1)  # (N * k,): token n's choices at n * k ..
        counts = torch.bincount(flat, minlength=self.num_experts)  # (E,)
        if tally is not None:
            tokens = tally.record(self.layer, tokens, counts, probs, self.top_k)
        order = flat.argsort(stable=True)  # copies sorted by expert, once
        source = order // self.top_k  # (N * k,) the token each sorted copy is of
        out = self.experts(tokens[source], counts)  # (N * k, D)
        out = out * weights.reshape(-1)[order, None].to(out.dtype)
        combined = torch.zeros_like(tokens).index_add_(0, source, out)  # (N, D)
        if hasattr(self, "shared_expert"):
            # (B, T, D) in: under sequence parallelism its tp layers gather along T
            shared = self.shared_expert(x).reshape(B * T, D)
            if hasattr(self, "shared_expert_gate"):
                shared = shared * torch.sigmoid(self.shared_expert_gate(tokens))
            combined = combined + shared
        return combined.view(B, T, D)


def is_moe_layer(cfg, layer: int) -> bool:
    """Qwen's ``decoder_sparse_step`` rule with DeepSeek's first dense layers."""
    return (
        cfg.n_experts > 0 and layer >= cfg.first_dense_layers and (layer + 1) % cfg.moe_every == 0
    )


def check_moe_config(cfg) -> None:
    """The mixture-of-experts sizes of a ``LlamaConfig`` with ``n_experts > 0``."""
    if not 1 <= cfg.experts_per_token <= cfg.n_experts:
        raise ValueError(
            f"--experts-per-token {cfg.experts_per_token} with {cfg.n_experts} experts; "
            f"valid: 1 to {cfg.n_experts}"
        )
    if cfg.router_score not in ROUTER_SCORES:
        raise ValueError(f"--router-score {cfg.router_score!r}; valid: {', '.join(ROUTER_SCORES)}")
    if cfg.moe_every < 1 or cfg.first_dense_layers < 0:
        raise ValueError(
            f"--moe-every {cfg.moe_every}, --first-dense-layers {cfg.first_dense_layers}; "
            "valid: --moe-every >= 1, --first-dense-layers >= 0"
        )
    if cfg.aux_loss_formula not in AUX_FORMULAS:
        raise ValueError(
            f"aux_loss_formula {cfg.aux_loss_formula!r}; valid: {', '.join(AUX_FORMULAS)}"
        )
    if cfg.shared_expert_gate and not cfg.shared_expert_size:
        raise ValueError(
            "shared_expert_gate needs a shared expert; valid: --shared-expert-size > 0"
        )
    if cfg.aux_loss_coef < 0 or cfg.bias_update_rate < 0:
        raise ValueError(
            f"--moe-aux-loss-coef {cfg.aux_loss_coef}, --moe-bias-update-rate "
            f"{cfg.bias_update_rate}; valid: >= 0"
        )
