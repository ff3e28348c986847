"""The element-wise traffic the GPU profiles price is what the families' own ops move.

``meshwise.planner.traffic`` holds bytes counted from the models' code; a change to
a norm, the rotary positions, the MLP or the loss that moves more (or less) must
show here, and the table be counted again (``python benchmarks/planner_traffic.py``).
"""

import pytest

from benchmarks.planner_traffic import layer_bytes
from meshwise.planner.layout import Layout
from meshwise.planner.shapes import ModelShape
from meshwise.planner.traffic import layer_traffic


def _shape(family, d, heads, kv_heads, head_dim, ffn) -> ModelShape:
    return ModelShape(
        family=family,
        n_layer=1,
        d_model=d,
        n_head=heads,
        n_kv_head=kv_heads,
        head_dim=head_dim,
        ffn=ffn,
        vocab=64,
        tied=False,
        layer_split=0,
        layer_replicated=0,
        embed_split=0,
        embed_replicated=0,
        final_replicated=0,
        head_split=0,
        layer_matmul=0,
    )


def _counted(family, sizes, mode, dtype) -> dict:
    counted = layer_bytes(family, sizes, mode, dtype)
    return {
        phase: sum(v for (p, _), v in counted.items() if p == phase)
        for phase in ("forward", "backward")
    }


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_llama_traffic_matches_a_count_of_its_ops(dtype):
    # widths unlike those the table was fitted on
    sizes = {"d_model": 320, "n_head": 5, "n_kv_head": 1, "head_size": 64, "ffn_hidden_size": 864}
    shape = _shape("llama", 320, 5, 1, 64, 864)
    table = layer_traffic(shape, Layout(), dtype)
    none = _counted("llama", sizes, "none", dtype)
    selective = _counted("llama", sizes, "selective", dtype)
    assert table["forward"] == pytest.approx(none["forward"], rel=0.03)
    assert table["backward"] == pytest.approx(none["backward"], rel=0.03)
    assert table["backward"] + table["recompute"] == pytest.approx(selective["backward"], rel=0.03)


def test_gpt_traffic_matches_a_count_of_its_ops():
    shape = _shape("gpt", 192, 3, 3, 64, 768)
    table = layer_traffic(shape, Layout(), "bf16")
    counted = _counted("gpt", {"d_model": 192, "n_head": 3}, "none", "bf16")
    assert table["forward"] == pytest.approx(counted["forward"], rel=0.03)
    assert table["backward"] == pytest.approx(counted["backward"], rel=0.03)


def test_tensor_parallelism_splits_the_inside_and_sequence_parallelism_the_rest():
    shape = _shape("llama", 4096, 32, 8, 128, 14336)
    whole = layer_traffic(shape, Layout(), "bf16")["backward"]
    tp = layer_traffic(shape, Layout(tp=4), "bf16")["backward"]
    sp = layer_traffic(shape, Layout(tp=4, sp=True), "bf16")["backward"]
    assert sp == pytest.approx(whole / 4)
    assert sp < tp < whole  # without --sp every tp rank runs the norms on the whole sequence
