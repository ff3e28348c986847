"""The planner's mixture-of-experts terms against hand-computed numbers: total and active
parameters, FLOPs from the active ones, expert state per rank at 1/ep with ZeRO over
dp x cp / ep, the all-to-all bytes per MoE layer."""

import pytest
import torch

from meshwise.planner.experts import all_to_all_bytes, expert_dp, valid_ep
from meshwise.planner.layout import Layout
from meshwise.planner.memory import Settings, model_state_bytes_per_param, peak_memory
from meshwise.planner.shapes import shape_of

DENSE = dict(
    family="llama",
    n_layer=4,
    n_head=4,
    n_kv_head=2,
    d_model=64,
    ffn_hidden_size=96,
    block_size=64,
    vocab_size=256,
    rope_theta=1e4,
    norm_eps=1e-5,
    tie_embeddings=False,
    rope_scaling=None,
)
# layer 0 dense, layers 1-3 MoE: 8 experts of width 32, top-2, a gated shared expert of 48
MOE = dict(
    DENSE,
    n_experts=8,
    experts_per_token=2,
    moe_ffn_hidden_size=32,
    first_dense_layers=1,
    shared_expert_size=48,
    shared_expert_gate=True,
)
# By hand, d 64: attention q, o 64 x 64, k, v 32 x 64 = 12,288; norms 128; a dense MLP
# 3 x 96 x 64 = 18,432; an MoE layer's router 8 x 64 = 512, shared expert 3 x 48 x 64 =
# 9,216 and its gate 64, routed experts 8 x 3 x 32 x 64 = 49,152 (top-2: 12,288 active);
# embedding and head 256 x 64 = 16,384 each, final norm 64.
DENSE_LAYER = 12288 + 128 + 18432
MOE_LAYER_OTHER = 12288 + 128 + 512 + 9216 + 64
EXPERTS = 49152
ROOT = 16384 + 16384 + 64


def test_total_and_active_parameters():
    shape = shape_of(MOE)
    assert shape.moe_layers == 3 and shape.expert_params == EXPERTS
    assert shape.num_params == DENSE_LAYER + 3 * (MOE_LAYER_OTHER + EXPERTS) + ROOT
    assert shape.active_params == DENSE_LAYER + 3 * (MOE_LAYER_OTHER + EXPERTS // 4) + ROOT
    assert shape_of(DENSE).active_params == shape_of(DENSE).num_params == 4 * DENSE_LAYER + ROOT


def test_flops_come_from_the_active_parameters():
    # nn.Linear weights a token multiplies by: a dense layer's attention and MLP; an MoE
    # layer's attention, router, shared expert and gate, and its top-2 experts
    matmul = (12288 + 18432) + 3 * (12288 + 512 + 9216 + 64 + 12288)
    flops = 6.0 * (matmul + 16384) + 12.0 * 4 * 64 * 32
    assert shape_of(MOE).model_flops_per_token(32) == pytest.approx(flops, rel=1e-12)


@pytest.mark.parametrize("zero", [0, 1, 2, 3])
def test_expert_state_falls_as_one_over_ep_with_zero_over_the_expert_dp_group(zero):
    shape = shape_of(MOE)
    st = Settings(seq_len=32, batch_size=8)
    states = {}
    for ep in (1, 2, 4):
        layout = Layout(dp=4, ep=ep, zero=zero)
        other = 3 * MOE_LAYER_OTHER + DENSE_LAYER + ROOT
        experts = 3 * EXPERTS / ep
        want = other * model_state_bytes_per_param(zero, 4, "fp32", "fp32")
        want += experts * model_state_bytes_per_param(zero, 4 // ep, "fp32", "fp32")
        memory = peak_memory(shape, layout, st, [1], 0.0)
        assert memory.model_state == pytest.approx(want, rel=1e-12), ep
        assert memory.params == round(other + experts)
        states[ep] = memory.model_state
    if zero < 3:
        assert states[4] < states[2] < states[1]
    else:  # ZeRO-3 already shards experts over dp x cp: 1/ep of them over dp x cp / ep
        assert states[4] == pytest.approx(states[1], rel=1e-12)
    assert expert_dp(4, 1, 2) == 2 and expert_dp(2, 2, 4) == 1


def test_all_to_all_bytes_per_moe_layer():
    # 4 passes x 1,024 tokens x top-2 x d 64 x 4 bytes x (ep - 1) / ep
    assert all_to_all_bytes(1024, 2, 64, 4, 1) == 0.0
    assert all_to_all_bytes(1024, 2, 64, 4, 2) == 4 * 1024 * 2 * 64 * 4 / 2 == 1048576
    assert all_to_all_bytes(1024, 2, 64, 4, 4) == 1572864
    assert all_to_all_bytes(1024, 2, 64, 2, 4, recompute=True) == 6 * 1024 * 2 * 64 * 2 * 3 / 4


def test_expert_parallel_degrees_divide_the_ranks_and_the_experts():
    assert valid_ep(8, 4) == [1, 2, 4]
    assert valid_ep(6, 4) == [1, 2]
    assert valid_ep(0, 8) == [1]


def test_the_layout_names_its_ep():
    layout = Layout(dp=4, ep=2, zero=1)
    assert "--ep 2" in layout.flags()
    assert Layout.parse(layout.flags()) == layout
    assert "--ep" not in Layout(dp=4).flags()


def test_the_shape_counts_the_moe_model_itself():
    from meshwise.models.families import family

    fam = family("llama")
    with torch.device("meta"):
        model = fam.build(fam.make_config(MOE))
    assert shape_of(MOE).num_params == sum(p.numel() for p in model.parameters())


def test_plan_searches_each_ep_that_divides_dp_cp_and_the_experts():
    from meshwise.cli.main import build_parser
    from meshwise.cli.plan import model_config
    from meshwise.planner.request import plan_request
    from meshwise.planner.search import Space

    flags = ["--model", "llama-tiny", "--n-experts", "4", "--seq-len", "64", "--batch-size", "8"]
    cfg = model_config(build_parser().parse_args(["plan", *flags]))
    space = Space(zero=(1,), schedules=("1f1b",), activation_checkpointing=("none",))
    listed = plan_request(cfg, 4, "cpu", space).run()
    by_dp_cp: dict[int, set[int]] = {}
    for p in listed:
        by_dp_cp.setdefault(p.layout.dp * p.layout.cp, set()).add(p.layout.ep)
    assert by_dp_cp[4] == {1, 2, 4} and by_dp_cp[2] == {1, 2} and by_dp_cp[1] == {1}
    state = {
        p.layout.ep: p.memory.model_state
        for p in listed
        if (p.layout.dp, p.layout.tp, p.layout.pp) == (4, 1, 1)
    }
    assert state[4] < state[2] < state[1]
