"""``--compile`` on gloo ranks: each layout's compiled run gives its eager run's losses and
gradient norms step by step (1e-5), with no graph break and no recompilation after
the first step, traced as inductor gets them: dynamo and AOTAutograd around the
engines' hooks, checkpointing and the collectives left eager.
"""

import pytest

pytestmark = pytest.mark.timeout(300)

STEPS = 20
LLAMA = {"preset": "llama-tiny", "n_layer": 2, "n_head": 2, "n_kv_head": 2, "d_model": 32}
GPT = {"preset": "tiny", "n_layer": 2, "n_head": 2, "d_model": 32}
MOE = {**LLAMA, "n_experts": 4, "moe_ffn_hidden_size": 32}
# Traced as inductor gets them (dynamo, AOTAutograd) and run by "aot_eager": inductor's
# codegen takes 10-20 s a graph here; tests/e2e/test_compile_cli.py runs it through the CLI.
SELECTIVE = {"activation_checkpointing": "selective"}
PARALLEL = {
    "1": {},
    "dp2-zero3": {"dp": 2, "zero": 3},
    "tp2-sp": {"tp": 2, "sp": True},
    "pp2-zb-h1": {"pp": 2, "schedule": "zb-h1", "micro_batches": 2},
    "cp2": {"cp": 2},
}
# Each family at each layout with selective checkpointing (the policy around a compiled
# block); full checkpointing and experts once.
LAYOUTS = {
    f"{name}-{layout}-selective": (model, {**parallel, **SELECTIVE})
    for name, model in (("llama", LLAMA), ("gpt", GPT))
    for layout, parallel in PARALLEL.items()
}
LAYOUTS["moe-dp2-ep2-full"] = (MOE, {"dp": 2, "ep": 2, "activation_checkpointing": "full"})


def _train(model: dict, layout: dict, data_path: str, compiled: bool):
    from meshwise.train.config import TrainConfig
    from meshwise.train.trainer import Trainer

    cfg = TrainConfig()
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, 32, 4
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, 3e-3
    cfg.runtime.device, cfg.runtime.quiet, cfg.runtime.compile = "cpu", True, compiled
    for key, value in layout.items():
        section = next(s for s in (cfg.runtime, cfg.data, cfg.parallel) if hasattr(s, key))
        setattr(section, key, value)
    trainer = Trainer(cfg.validate(), data_path)
    records, graphs = [], []
    for step in range(1, STEPS + 1):
        records.append(trainer.train_step(step))
        graphs.append(_graph_count())
    trainer.comm_stats.close()
    return [(r["loss"], r["grad_norm"]) for r in records], graphs


def _graph_count() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _eager_and_compiled(model: dict, layout: dict, data_path: str):
    import torch._dynamo
    from torch._dynamo.utils import counters

    import meshwise.apply.compile

    torch._dynamo.reset()  # as a fresh run: no other layout's graphs in this pool rank
    meshwise.apply.compile.BACKEND = "aot_eager"
    counters.clear()
    eager, _ = _train(model, layout, data_path, compiled=False)
    compiled, graphs = _train(model, layout, data_path, compiled=True)
    return eager, compiled, graphs, dict(counters["graph_break"])


def test_compiled_layouts_train_as_eager(dist_pools, tokens):
    for name, (model, layout) in LAYOUTS.items():
        world = 1
        for axis in ("dp", "tp", "pp", "cp"):
            world *= layout.get(axis, 1)
        results = dist_pools.run(world, _eager_and_compiled, model, layout, tokens)
        eager, compiled, graphs, breaks = results[0]
        for step, (got, want) in enumerate(zip(compiled, eager), 1):
            assert got == pytest.approx(want, rel=1e-5), (name, step)
        for rank, (_, _, graphs, breaks) in enumerate(results):
            assert not breaks, (name, rank, breaks)
            assert graphs[0] > 0, (name, rank)  # something compiled on every rank
            assert graphs[-1] == graphs[0], (name, rank, graphs)  # no recompilation
