"""The weights of a Hugging Face Llama-family folder (Mixtral, Qwen3-MoE and Qwen2-MoE
included) as meshwise's logical tensors, read piece by piece: a rank that holds a few
experts of a layer opens only those experts' tensors, and only the rows its piece covers.
"""

from __future__ import annotations

from pathlib import Path

import torch

from meshwise.geometry.pieces import Piece
from meshwise.hf.llama import hf_shapes
from meshwise.hf.moe import expert_name, fused_name, router_name, stacked_expert
from meshwise.hf.safetensors_dir import SafetensorsDir
from meshwise.models.moe import is_moe_layer


class LlamaWeights:
    """``read(piece)``: the elements of one piece of our tensor ``piece.name``, flat, in
    float32, from the folder's files (experts from their published per-expert tensors, or
    from transformers 5's fused ``gate_up_proj`` / ``down_proj`` where the folder has those)."""

    def __init__(self, directory: str | Path, cfg):
        self.files = SafetensorsDir(directory)
        self.cfg = cfg

    def check(self) -> None:
        """Every tensor config.json implies is there with its shape (headers only); an MoE
        layer's experts either one tensor per expert or fused."""
        expected = hf_shapes(self.cfg)
        optional = ("lm_head.weight",) if self.cfg.tie_embeddings else ()
        for layer in range(self.cfg.n_layer):
            if is_moe_layer(self.cfg, layer) and self._fused(layer):
                for j in range(self.cfg.n_experts):
                    for projection in ("gate_proj", "up_proj", "down_proj"):
                        del expected[expert_name(self.cfg, layer, projection, j)]
                expected.update(self._fused_shapes(layer))
                router = f"layers.{layer}.mlp.gate.weight"  # Mixtral's too, in that form
                expected[f"model.{router}"] = expected.pop(router_name(self.cfg, router))
        self.files.check(expected, optional)

    def read(self, piece: Piece) -> torch.Tensor:
        if piece.name.endswith(".expert_bias"):  # routing-only bias: no family stores one
            return torch.zeros(piece.numel)
        stacked = stacked_expert(piece.name)
        if stacked is None:
            stored = router_name(self.cfg, piece.name)
            if stored != f"model.{piece.name}" and not self.files.has(stored):
                stored = f"model.{piece.name}"  # Mixtral's router as transformers 5 holds it
            return self.files.read(stored, piece)
        layer, projection = stacked
        if self._fused(layer):
            return self._read_fused(layer, projection, piece)
        return self._read_per_expert(layer, projection, piece)

    def _fused(self, layer: int) -> bool:
        return not self.files.has(expert_name(self.cfg, layer, "down_proj", 0)) and self.files.has(
            fused_name(layer, "down_proj")
        )

    def _fused_shapes(self, layer: int) -> dict[str, tuple[int, ...]]:
        d, e = self.cfg.d_model, self.cfg.n_experts
        f = self.cfg.moe_ffn_hidden_size or self.cfg.ffn_hidden_size
        gate_up, down = fused_name(layer, "gate_proj"), fused_name(layer, "down_proj")
        return {gate_up: (e, 2 * f, d), down: (e, d, f)}

    def _read_per_expert(self, layer: int, projection: str, piece: Piece) -> torch.Tensor:
        """The piece's run cut at expert boundaries: expert j's part is a piece of its own
        (F, D) or (D, F) tensor, same box, its run shifted by j's offset in the box."""
        per_expert = piece.box_sizes[1] * piece.box_sizes[2]  # elements of one expert in the box
        parts = []
        for k in range(piece.box_sizes[0]):
            start = max(piece.flat_start, k * per_expert)
            end = min(piece.flat_end, (k + 1) * per_expert)
            if start >= end:
                continue
            expert = piece.box_offsets[0] + k
            name = expert_name(self.cfg, layer, projection, expert)
            part = Piece(
                name,
                piece.shape[1:],
                piece.box_offsets[1:],
                piece.box_sizes[1:],
                start - k * per_expert,
                end - k * per_expert,
            )
            parts.append(self.files.read(name, part))
        return torch.cat(parts) if parts else torch.zeros(0)

    def _read_fused(self, layer: int, projection: str, piece: Piece) -> torch.Tensor:
        """gate_proj is rows [0, F) of each expert's gate_up_proj, up_proj rows [F, 2F)."""
        name = fused_name(layer, projection)
        if projection == "down_proj":
            return self.files.read(name, Piece(name, *_fields(piece)))
        e, f, d = piece.shape
        shift = f if projection == "up_proj" else 0
        offsets = (piece.box_offsets[0], piece.box_offsets[1] + shift, piece.box_offsets[2])
        run = (piece.flat_start, piece.flat_end)
        return self.files.read(name, Piece(name, (e, 2 * f, d), offsets, piece.box_sizes, *run))


def _fields(piece: Piece) -> tuple:
    return (piece.shape, piece.box_offsets, piece.box_sizes, piece.flat_start, piece.flat_end)


def stored_tensors(cfg, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Our full logical tensors under the names the family's folders use: each MoE layer's
    stacked experts split into one tensor per expert (ValueError for a routing bias that a
    Hugging Face family cannot hold)."""
    out = {}
    for name, tensor in tensors.items():
        if name.endswith(".expert_bias"):
            if bool(tensor.any()):
                raise ValueError(
                    f"--format hf: {name} is not zero and a {cfg.hf_type} model has no routing "
                    "bias; valid: --format safetensors, or a model trained without "
                    "--moe-bias-update-rate"
                )
            continue
        stacked = stacked_expert(name)
        if stacked is None:
            out[router_name(cfg, name)] = tensor
            continue
        layer, projection = stacked
        for j in range(tensor.shape[0]):
            out[expert_name(cfg, layer, projection, j)] = tensor[j]  # (F, D) or (D, F)
    return out
