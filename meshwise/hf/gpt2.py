"""Hugging Face's GPT-2 (``GPT2LMHeadModel``) read into meshwise's GPT, slice by slice.

Its ``Conv1D`` weights are ``(in, out)``, our transpose, and its ``c_attn`` columns are
``(3, n_head, head_dim)`` where our ``qkv`` rows are ``(n_head, 3, head_dim)`` (whole heads
per tp split): a rank reads the stored blocks its box maps to, never the whole model.
"""

from __future__ import annotations

import torch

from meshwise.geometry.pieces import Piece
from meshwise.hf.llama import check_types
from meshwise.hf.safetensors_dir import SafetensorsDir

ARCHITECTURE = "GPT2LMHeadModel"
# Our GPTConfig field <- config.json key.
SIZES = {
    "n_layer": "n_layer",
    "n_head": "n_head",
    "d_model": "n_embd",
    "block_size": "n_positions",
    "vocab_size": "vocab_size",
}
KEY_TYPES = {
    **{key: "int" for key in SIZES.values()},
    "n_inner": "int?",
    "layer_norm_epsilon": "number",
    "activation_function": "str",
    "scale_attn_by_inverse_layer_idx": "bool",
    "add_cross_attention": "bool",
    "tie_word_embeddings": "bool",
    "model_type": "str",
    "architectures": "list?",
}
CONV1D = ("attn.c_proj", "mlp.c_fc", "mlp.c_proj")
OURS = {
    "attn.c_proj": "attn.proj",
    "mlp.c_fc": "mlp.fc",
    "mlp.c_proj": "mlp.proj",
    "ln_1": "ln1",
    "ln_2": "ln2",
}


def gpt2_sizes(config: dict, where: str) -> dict:
    """Our GPT's sizes from a GPT-2 ``config.json``; ValueError naming what we do not compute."""
    check_types(config, KEY_TYPES, f"{where}/config.json")
    missing = [key for key in SIZES.values() if key not in config]
    if missing:
        raise ValueError(f"--init-from {where}: config.json lacks {', '.join(missing)}")
    sizes = {ours: config[theirs] for ours, theirs in SIZES.items()}
    d = sizes["d_model"]
    unsupported = [
        (
            config.get("activation_function", "gelu_new") not in ("gelu_new", "gelu_pytorch_tanh"),
            f"activation_function {config.get('activation_function')!r}",
            "'gelu_new'",
        ),
        (
            (config.get("n_inner") or 4 * d) != 4 * d,
            f"n_inner {config.get('n_inner')}",
            f"4 x n_embd = {4 * d}",
        ),
        (
            config.get("layer_norm_epsilon", 1e-5) != 1e-5,
            f"layer_norm_epsilon {config.get('layer_norm_epsilon')}",
            "1e-05",
        ),
        (
            config.get("scale_attn_by_inverse_layer_idx", False),
            "scale_attn_by_inverse_layer_idx true",
            "false",
        ),
        (config.get("add_cross_attention", False), "add_cross_attention true", "false"),
        (
            not config.get("tie_word_embeddings", True),
            "tie_word_embeddings false (an untied head)",
            "true",
        ),
    ]
    for bad, what, valid in unsupported:
        if bad:
            raise ValueError(
                f"--init-from {where}: config.json has {what}, which meshwise's "
                f"GPT does not compute; valid: {valid}"
            )
    if d % sizes["n_head"]:
        raise ValueError(
            f"--init-from {where}: n_embd {d} is not divisible by n_head {sizes['n_head']}"
        )
    return sizes


class GPT2Weights:
    """A GPT-2 directory's tensors as pieces of our GPT's (``read(piece)``)."""

    def __init__(self, directory, n_head: int):
        self.files = SafetensorsDir(directory)
        # The original checkpoints name tensors without the ``transformer.`` prefix.
        self.prefix = "transformer." if self.files.has("transformer.wte.weight") else ""
        self.n_head = n_head

    def stored_shapes(self, sizes: dict) -> dict[str, tuple[int, ...]]:
        """Every tensor config.json implies, by its stored name, with its shape."""
        d, p = sizes["d_model"], self.prefix
        shapes = {
            p + "wte.weight": (sizes["vocab_size"], d),
            p + "wpe.weight": (sizes["block_size"], d),
            p + "ln_f.weight": (d,),
            p + "ln_f.bias": (d,),
        }
        for i in range(sizes["n_layer"]):
            h = f"{p}h.{i}."
            shapes.update(
                {
                    h + "attn.c_attn.weight": (d, 3 * d),
                    h + "attn.c_attn.bias": (3 * d,),
                    h + "attn.c_proj.weight": (d, d),
                    h + "mlp.c_fc.weight": (d, 4 * d),
                    h + "mlp.c_proj.weight": (4 * d, d),
                }
            )
            for name, width in (
                ("attn.c_proj", d),
                ("mlp.c_fc", 4 * d),
                ("mlp.c_proj", d),
                ("ln_1", d),
                ("ln_2", d),
            ):
                shapes[h + name + ".bias"] = (width,)
            shapes.update({h + "ln_1.weight": (d,), h + "ln_2.weight": (d,)})
        return shapes

    def read(self, piece: Piece) -> torch.Tensor:
        """The elements of ``piece`` of our logical tensor ``piece.name``, flat, float32."""
        name = piece.name
        if not name.startswith("blocks."):
            return self.files.read(self.prefix + name, piece)  # same layout
        _, index, rest = name.split(".", 2)
        module, _, kind = rest.rpartition(".")
        theirs = next((t for t, o in OURS.items() if o == module), module)
        stored = f"{self.prefix}h.{index}.{theirs}.{kind}"
        if module == "attn.qkv":
            box = self._qkv_box(f"{self.prefix}h.{index}.attn.c_attn.{kind}", piece)
        elif theirs in CONV1D and kind == "weight":
            (r0, c0), (rs, cs) = piece.box_offsets, piece.box_sizes
            their = Piece.box(stored, piece.shape[::-1], (c0, r0), (cs, rs))
            box = self.files.read(stored, their).view(cs, rs).t()  # (rows, cols) of ours
        else:
            return self.files.read(stored, piece)  # biases and LayerNorms: same layout
        return box.reshape(-1)[piece.flat_start : piece.flat_end].contiguous()

    def _qkv_box(self, stored: str, piece: Piece) -> torch.Tensor:
        """Our qkv rows ``(n_head, 3, hd)`` of the piece's box, from c_attn's columns
        ``(3, n_head, hd)`` (and its input rows, transposed, for the weight)."""
        rows = piece.shape[0]
        hd = rows // (3 * self.n_head)
        r0, rs = piece.box_offsets[0], piece.box_sizes[0]
        h0, h1 = r0 // (3 * hd), -(-(r0 + rs) // (3 * hd))  # the heads the box touches
        d = self.n_head * hd
        blocks = []
        for s in range(3):  # q, k, v: columns s*d + h*hd of the heads touched
            start = s * d + h0 * hd
            if len(piece.shape) == 2:
                c0, cs = piece.box_offsets[1], piece.box_sizes[1]
                their = Piece.box(stored, (piece.shape[1], rows), (c0, start), (cs, (h1 - h0) * hd))
                blocks.append(self.files.read(stored, their).view(cs, h1 - h0, hd))
            else:
                their = Piece.box(stored, (rows,), (start,), ((h1 - h0) * hd,))
                blocks.append(self.files.read(stored, their).view(1, h1 - h0, hd))
        full = torch.stack(blocks, dim=2)  # (in, heads, 3, hd)
        full = full.permute(1, 2, 3, 0).reshape((h1 - h0) * 3 * hd, -1)  # (rows, in)
        local = full[r0 - h0 * 3 * hd : r0 - h0 * 3 * hd + rs]
        return local if len(piece.shape) == 2 else local[:, 0]
