"""``--compile``'s plumbing without compiling: what compiles in a block, names unchanged,
and a compiler that cannot serve refused before any rank starts (the compiled runs'
parity is tests/dist/test_compile.py's)."""

import pytest
import torch
from torch import nn

from meshwise.apply.activation_checkpointing import apply_activation_checkpointing
from meshwise.apply.compile import Compiled, compile_blocks
from meshwise.models.families import family
from tests.unit.test_config import parse


def _llama(**sizes):
    """A tiny Llama (two layers unless ``sizes`` say otherwise)."""
    fam = family("llama")
    sizes = {
        "family": "llama",
        "n_layer": 2,
        "n_head": 2,
        "n_kv_head": 2,
        "d_model": 32,
        "vocab_size": 64,
        "seq_len": 16,
        **sizes,
    }
    return fam.build(fam.make_config(sizes))


def test_compiled_blocks_keep_their_names_and_hooks():
    eager, model = _llama(), _llama()
    hook = model.layers["0"].register_forward_pre_hook(lambda module, args: None)
    assert compile_blocks(model.layers) == ["DecoderLayer"]
    apply_activation_checkpointing(model.layers, "full")
    for layer in model.layers.values():
        assert isinstance(layer, Compiled) and isinstance(layer, type(eager.layers["0"]))
    assert list(model.state_dict()) == list(eager.state_dict())
    assert not any("_orig_mod" in name for name in model.state_dict())
    # The hook stays on the module, run by its __call__ outside the compiled forward.
    assert hook.id in model.layers["0"]._forward_pre_hooks


def test_a_split_backward_keeps_linear_layers_out_of_the_graph():
    model = _llama()
    # zero-bubble's W actions defer each nn.Linear's weight gradient: those run eager.
    compiled = compile_blocks(model.layers, split_backward=True)
    assert compiled == ["RMSNorm", "ScaledDotProductAttention"]
    assert not any(isinstance(m, nn.Linear) and isinstance(m, Compiled) for m in model.modules())


def test_compile_without_a_cpp_compiler_is_refused_before_spawning(monkeypatch, tmp_path):
    from torch._inductor import cpp_builder

    from meshwise.cli.preflight import prepare

    def no_compiler():
        raise RuntimeError("no C++ compiler among g++, clang++")

    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # the check would set it
    with pytest.raises(ValueError, match="--compile on the CPU needs a C..? compiler"):
        prepare(parse("--compile", "--device", "cpu"))


def test_compile_on_a_python_without_dynamo_is_refused(monkeypatch, tmp_path):
    from meshwise.cli.preflight import prepare

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))

    monkeypatch.setattr(torch._dynamo, "is_dynamo_supported", lambda: False)
    with pytest.raises(ValueError, match="--compile: torch .* does not run on this Python"):
        prepare(parse("--compile", "--device", "cpu"))


def test_moe_experts_run_eager_around_the_compiled_parts():
    from meshwise.models.moe import Experts

    model = _llama(n_layer=1, n_experts=4, experts_per_token=2, shared_expert_size=16)
    # The experts read their token counts to the host: a graph break, kept out.
    assert compile_blocks(model.layers) == ["RMSNorm", "Attention", "MLP"]
    assert not any(isinstance(m, Experts) and isinstance(m, Compiled) for m in model.modules())


def test_blocks_and_loss_equal_eager_recompiling_once_per_new_shape(monkeypatch):
    """At tp 1 the blocks (one graph for both), the final norm and the cross entropy
    compile, give eager's loss and gradients, and compile again only for a new batch
    shape, once; under tp the loss issues collectives and stays eager. Traced as inductor
    gets them, run by aot_eager (inductor's kernels: tests/e2e/test_compile_cli.py)."""
    import copy
    import types

    from torch._dynamo.utils import counters

    import meshwise.apply.compile as compile_module
    from meshwise.apply.compile import compile_loss
    from meshwise.apply.parallelize import parallelize
    from meshwise.models.gpt import GPT, GPTConfig, gpt_plan

    cfg = GPTConfig(n_layer=2, n_head=2, d_model=32, block_size=16, vocab_size=50)
    with torch.device("meta"):
        sharded = parallelize(
            GPT(cfg), gpt_plan(cfg), tp_group=types.SimpleNamespace(rank=0, size=2)
        )
    assert compile_loss(sharded) == ["LayerNorm"] and sharded.compiled_loss is None

    monkeypatch.setattr(compile_module, "BACKEND", "aot_eager")
    torch._dynamo.reset()
    counters.clear()
    eager = parallelize(GPT(cfg).init_weights(0), gpt_plan(cfg), vocab_size=50)
    model = copy.deepcopy(eager)
    assert compile_blocks(model.layers()) == ["Block"]
    assert compile_loss(model) == ["LayerNorm", "cross_entropy"]
    for m in (eager, model):
        apply_activation_checkpointing(m.layers(), "full")  # the recompute replays the graph
    graphs = []
    for step, batch in enumerate((2, 2, 2, 3, 3)):  # the last two: a shorter last batch
        x, y = torch.randint(0, 50, (2, batch, 16), generator=torch.Generator().manual_seed(step))
        losses = [m.loss(m.chunks[0](x), y) for m in (eager, model)]
        for loss in losses:
            loss.backward()
        assert losses[1].item() == pytest.approx(losses[0].item(), rel=1e-5)
        for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"]
    # the blocks', the final norm's and the loss's graphs; a new shape: each once more
    assert graphs == [3, 3, 3, 6, 6]


def test_the_planner_prices_compiled_layers_by_the_calibrated_ratio(tmp_path):
    from meshwise.planner.compute import action_costs
    from meshwise.planner.devices import save_calibration
    from meshwise.planner.layout import Layout
    from meshwise.planner.request import plan_request
    from meshwise.planner.search import Space, settings_of
    from meshwise.train.config import TrainConfig

    save_calibration(
        {"layer_time_factor": {"llama": 1.5}, "compiled_layer_ratio": {"llama": 0.6}}, tmp_path
    )
    costs = []
    for compiled in (False, True):
        cfg = TrainConfig()
        cfg.model.preset, cfg.runtime.compile = "llama-tiny", compiled
        request = plan_request(cfg, 1, "cpu", Space(), cache_dir=str(tmp_path))
        st = settings_of(cfg, request.device)
        costs.append(action_costs(request.shape, Layout(), st, request.device, 2, False, False))
    eager, compiled_costs = costs
    for part in ("forward", "backward", "weights"):
        assert getattr(compiled_costs, part) == pytest.approx(0.6 * getattr(eager, part)), part
