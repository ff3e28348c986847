"""The planner under LoRA and QLoRA: the model state it predicts is what a Trainer counts
(built in this process, a gloo group of one), at ZeRO-3 and tp the documented formula;
a LoRA run fits layouts full training does not; ``meshwise plan`` and ``--layout auto``
take the run's LoRA settings."""

import numpy as np
import pytest
import torch.distributed as dist

from meshwise.cli.main import build_parser
from meshwise.cli.plan import model_config
from meshwise.planner.layout import Layout
from meshwise.planner.lora import NF4_BYTES_PER_PARAM, nf4_fits_tp
from meshwise.planner.memory import Settings, peak_memory
from meshwise.planner.request import NoLayoutFits, plan_request
from meshwise.planner.search import Space
from meshwise.planner.shapes import model_shape
from meshwise.train.config import TrainConfig
from meshwise.train.lora_setup import adapter_shapes
from tests.e2e.conftest import run_main

# rows of 128 values: whole NF4 blocks, also at tp 2
TINY = dict(preset="llama-tiny", n_layer=2, d_model=128, n_head=4, n_kv_head=2, ffn_hidden_size=128)
BIG = ["--model", "llama-1b", "--seq-len", "256", "--batch-size", "2", "--device", "h100"]


def _config(zero=0, dtype="fp32", targets="all-linear", quantize_base="none", **layout):
    cfg = TrainConfig()
    for key, value in TINY.items():
        setattr(cfg.model, key, value)
    cfg.lora.lora_rank, cfg.lora.lora_targets, cfg.lora.quantize_base = 4, targets, quantize_base
    cfg.data.seq_len, cfg.data.batch_size = 16, 4
    cfg.runtime.device, cfg.runtime.quiet, cfg.runtime.dtype = "cpu", True, dtype
    cfg.parallel.zero = zero
    for key, value in layout.items():
        setattr(cfg.parallel, key, value)
    return cfg


def _predicted(cfg: TrainConfig):
    settings = Settings(cfg.data.seq_len, cfg.data.batch_size, dtype=cfg.runtime.dtype)
    return peak_memory(model_shape(cfg), Layout.of(cfg), settings, [1], 0.0)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A gloo group of one in this process, and a token file to build Trainers on."""
    from meshwise.comm import ops

    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    np.random.default_rng(2).integers(0, 256, 2_000).astype(np.uint16).tofile(path)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield str(path)
    ops.destroy_process_group()


@pytest.mark.parametrize(
    "zero, dtype, targets, quantize_base",
    [
        (0, "fp32", "all-linear", "none"),
        (1, "bf16", "all-linear", "none"),
        (2, "fp32", "q_proj,v_proj", "none"),
        (3, "fp32", "all-linear", "none"),  # the frozen weights in the engine's shards
        (3, "bf16", "all-linear", "none"),
        (0, "fp32", "all-linear", "nf4"),
        (2, "bf16", "all-linear", "nf4"),
    ],
)
def test_the_model_state_predicted_is_what_the_trainer_counts(
    one_rank, zero, dtype, targets, quantize_base
):
    from meshwise.train.trainer import Trainer

    cfg = _config(zero, dtype, targets, quantize_base)
    cfg.data.path = one_rank
    trainer = Trainer(cfg.validate(), one_rank)
    trainer.comm_stats.close()
    counted = trainer.engine.state_bytes() + trainer.frozen_bytes
    predicted = _predicted(cfg)
    assert predicted.model_state == counted
    if zero < 3:  # held beside the engine; at ZeRO-3 the engine holds their shards
        assert predicted.frozen == trainer.frozen_bytes


def test_zero_3_and_tp_shard_the_model_state_as_the_formula_says():
    """Adapters from the run's own shapes under tp 2: a column-parallel layer's B split and
    A whole, a row-parallel layer's A split and B whole; 16 B each over ZeRO's 2 ranks at
    ZeRO-3, which shards the frozen weights' 4 B too."""
    cfg = _config(zero=3, dp=2, tp=2)
    row_parallel = ("o_proj", "down_proj")
    adapters = 0
    for name, (rows, cols) in adapter_shapes(cfg, 256).items():
        split = name.endswith("lora_A") == name.rpartition(".")[0].endswith(row_parallel)
        adapters += rows * cols // (2 if split else 1)
    m = _predicted(cfg)
    assert m.model_state - m.frozen == 16 * adapters / 2
    assert m.frozen == 4 * m.params / 2
    # QLoRA at ZeRO-1: every linear weight of the blocks held whole as NF4 by each tp
    # rank (half of each), the rest in fp32
    cfg = _config(zero=1, dp=2, tp=2, quantize_base="nf4")
    d, kv, ffn = 128, 64, 128
    nf4 = 2 * (2 * d * d + 2 * d * kv + 3 * d * ffn) // 2
    m = _predicted(cfg)
    assert m.frozen == 4 * (m.params - nf4) + NF4_BYTES_PER_PARAM * nf4
    assert m.model_state - m.frozen == (8 + 8 / 2) * adapters


def config(*flags) -> TrainConfig:
    return model_config(build_parser().parse_args(["plan", *map(str, flags)]))


def test_lora_fits_layouts_that_full_training_does_not():
    """llama-1b on 2 H100s of 10 GiB at dp 2: full training fits only ZeRO-3; LoRA
    fits every stage, and less sharding is faster (no ZeRO-3 gathers)."""
    space = Space(axes={"dp": 2})
    full = plan_request(config(*BIG), 2, "h100", space, memory_gb=10).run()
    assert {p.layout.zero for p in full} == {3}
    lora = plan_request(config(*BIG, "--lora-rank", 8), 2, "h100", space, memory_gb=10).run()
    assert {p.layout.zero for p in lora} == {0, 1, 2, 3}
    assert lora[0].layout.zero < 3
    assert lora[0].memory.total < full[0].memory.total / 2
    # the backward of a frozen layer computes no weight gradients, and dp reduces adapters
    assert lora[0].time.compute < full[0].time.compute * 0.75
    assert lora[0].time.dp < full[0].time.dp / 10


def test_qlora_dequantises_and_leaves_out_a_tp_that_cuts_blocks():
    lora = plan_request(config(*BIG, "--lora-rank", 8), 2, "h100", Space())
    qlora = plan_request(
        config(*BIG, "--lora-rank", 8, "--quantize-base", "nf4"), 2, "h100", Space()
    )
    layout = Layout(dp=2, zero=1)
    plain, quantised = lora.predict(layout), qlora.predict(layout)
    assert quantised.memory.frozen < plain.memory.frozen / 3
    assert quantised.time.compute > plain.time.compute  # each pass dequantises
    # llama-1b's o_proj rows: 2048 values, whole 64-value blocks up to tp 32
    assert nf4_fits_tp(qlora.shape, 32) and not nf4_fits_tp(qlora.shape, 64)
    cfg = _config(quantize_base="nf4")
    assert nf4_fits_tp(model_shape(cfg), 2) and not nf4_fits_tp(model_shape(cfg), 4)
    # where nothing fits, the world that would is searched at QLoRA's highest stage, 2
    small = plan_request(qlora.cfg, 2, "h100", Space(), memory_gb=1.7)
    with pytest.raises(NoLayoutFits, match=r"or --world 8$"):
        small.run()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_dequantise_is_priced_as_its_ops_move(dtype):
    import torch

    from benchmarks.planner_traffic import DTYPES, OpBytes
    from meshwise.apply.nf4 import NF4Weight
    from meshwise.planner.lora import DEQUANTIZE_BYTES, DEQUANTIZE_KERNELS

    weight = NF4Weight.of(torch.randn(64, 256), DTYPES[dtype])
    with OpBytes(d_model=1) as ops:
        weight.dense()
    assert sum(ops.bytes.values()) / (64 * 256) == pytest.approx(DEQUANTIZE_BYTES[dtype], rel=0.01)
    assert sum(ops.kernels.values()) == DEQUANTIZE_KERNELS[dtype]


def test_plan_explains_frozen_weights_and_adapters(tmp_path):
    flags = [*BIG, "--world", 2, "--lora-rank", 8, "--lora-targets", "q_proj,v_proj"]
    out = run_main("plan", *flags, "--explain", "--dp 2 --zero 1", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "LoRA rank 8 on q_proj,v_proj" in out.stdout
    assert "frozen weights" in out.stdout and "adapters" in out.stdout
    out = run_main("plan", *flags[:-1], "bogus", cwd=tmp_path)
    assert out.returncode == 2 and "--lora-targets 'bogus' matches no linear layer" in out.stderr


def test_layout_auto_plans_the_runs_lora(tmp_path, monkeypatch):
    from meshwise.cli import auto_layout
    from meshwise.cli.train import train_config

    asked = []

    def recorded(*args, **kwargs):
        asked.append(plan_request(*args, **kwargs))
        return asked[-1]

    monkeypatch.setattr(auto_layout, "plan_request", recorded)
    flags = ["train", "--layout", "auto", "--dp", "2", "--model", "llama-tiny", "--seq-len", "64"]
    flags += ["--lora-rank", "4", "--quantize-base", "nf4", "--cache-dir", str(tmp_path)]
    cfg, _ = train_config(build_parser().parse_args(flags))
    lora = asked[0].shape.lora
    assert lora is not None and lora.rank == 4 and lora.quantized
    assert Layout.of(cfg) == asked[0].run()[0].layout


def test_model_flops_are_the_trainers_count_of_the_adapted_model():
    """4 FLOPs per frozen weight, 6 per adapter weight, in the plan as in the run's MFU."""
    from meshwise.apply.lora import add_adapters
    from meshwise.geometry.init import on_meta
    from meshwise.models.families import family
    from meshwise.train.flops import flops_per_token

    cfg = _config(targets="q_proj,v_proj,down_proj")
    fam = family(cfg.model.family)
    model_cfg = fam.make_config(cfg.model.sizes(256))
    with on_meta():
        model = fam.build(model_cfg)
    plan = fam.plan(model_cfg)
    add_adapters([model], cfg.lora, plan.last_stage)
    layers = list(getattr(model, plan.layers).values())
    counted, _ = flops_per_token(model, layers, model_cfg.n_layer, model_cfg.d_model, 64)
    cfg.model.vocab_size = 256
    assert model_shape(cfg).model_flops_per_token(64) == pytest.approx(counted, rel=1e-12)


def test_the_suggested_command_carries_what_the_plan_priced():
    from meshwise.planner.report import planned_as

    cfg = _config(targets="q_proj,v_proj", quantize_base="nf4")
    assert planned_as(cfg) == " --lora-rank 4 --lora-targets q_proj,v_proj --quantize-base nf4"
    cfg = TrainConfig()
    cfg.runtime.compile = True
    assert planned_as(cfg) == " --compile"
    assert planned_as(TrainConfig()) == ""
