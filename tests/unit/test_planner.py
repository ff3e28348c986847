"""``meshwise plan``: the cost model's pieces, the search's rules and the command's answers.

Whether the predictions agree with measurement is ``tests/e2e/test_planner_memory.py``
(memory, in CI) and ``benchmarks/planner.py`` (memory and step time)."""

import json

import pytest
import torch

from meshwise.cli.main import build_parser
from meshwise.cli.plan import model_config
from meshwise.models.families import family
from meshwise.planner.devices import device_profile
from meshwise.planner.layout import Layout
from meshwise.planner.memory import model_state_bytes_per_param
from meshwise.planner.request import NoLayoutFits, plan_request
from meshwise.planner.search import Space
from meshwise.planner.shapes import model_shape
from meshwise.planner.step_time import in_flight
from meshwise.train.config import MODEL_PRESETS, TrainConfig
from tests.e2e.conftest import run_main

SMALL = ["--model", "small", "--n-layer", "4", "--seq-len", "128", "--batch-size", "8"]


def config(*flags) -> TrainConfig:
    return model_config(build_parser().parse_args(["plan", *map(str, flags)]))


@pytest.mark.parametrize("preset", list(MODEL_PRESETS))
def test_the_shape_counts_the_parameters_of_the_model_itself(preset):
    cfg = TrainConfig()
    cfg.model.preset = preset
    fam = family(cfg.model.family)
    with torch.device("meta"):
        model = fam.build(fam.make_config(cfg.model.sizes(256)))
    assert model_shape(cfg).num_params == sum(p.numel() for p in model.parameters())


def test_tensor_parallel_shards_add_up_to_the_layer():
    shape = model_shape(config(*SMALL))
    # GPT block: all but two LayerNorms (weight, bias) and the row layers' biases is split
    assert shape.layer_replicated == 6 * shape.d_model
    d = shape.d_model
    assert shape.layer_split + shape.layer_replicated == 12 * d**2 + 13 * d


def test_model_state_is_the_readme_table():
    assert model_state_bytes_per_param(0, 4, "fp32", "fp32") == 16
    assert model_state_bytes_per_param(1, 4, "fp32", "fp32") == 8 + 8 / 4
    assert model_state_bytes_per_param(2, 4, "fp32", "fp32") == 4 + 12 / 4
    assert model_state_bytes_per_param(3, 4, "fp32", "fp32") == 16 / 4
    assert model_state_bytes_per_param(0, 4, "bf16", "fp32") == 18
    assert model_state_bytes_per_param(1, 4, "bf16", "bf16") == 2 + 2 + 12 / 4
    assert model_state_bytes_per_param(2, 4, "bf16", "fp32") == 2 + 16 / 4


def test_in_flight_micro_batches_come_from_the_simulator():
    # 1F1B keeps S - r micro-batches on rank r; GPipe all of them
    assert in_flight(Layout(pp=4, micro_batches=8)) == [4, 3, 2, 1]
    assert in_flight(Layout(pp=4, schedule="gpipe", micro_batches=8)) == [8] * 4


def test_every_listed_layout_passes_the_configuration_check_and_no_other_does():
    cfg = config("--model", "llama-small", "--n-layer", "4", "--seq-len", "64", "--batch-size", "8")
    request = plan_request(cfg, 4, "cpu", Space())
    listed = request.run()
    assert listed
    for p in listed:
        p.layout.apply(cfg).validate()
        assert p.layout.world_size == 4
    # llama-small has 2 key/value heads: tp 4 can never be listed
    assert not any(p.layout.tp == 4 for p in listed)
    assert {p.layout.tp for p in listed} == {1, 2}
    ranked = [float(f"{p.tokens_per_s:.3g}") for p in listed]  # ties: less memory first
    assert ranked == sorted(ranked, reverse=True)


def test_flags_round_trip_through_parse():
    layout = Layout(
        dp=2,
        cp=2,
        tp=2,
        pp=2,
        sp=True,
        schedule="zbv",
        virtual_stages=2,
        micro_batches=4,
        zero=3,
        activation_checkpointing="selective",
    )
    assert Layout.parse(layout.flags()) == layout
    cfg = config(*SMALL)
    assert Layout.of(layout.apply(cfg)) == layout


def test_more_ranks_per_axis_lower_the_memory_the_formulas_say():
    request = plan_request(config(*SMALL), 4, "cpu", Space())
    zero0 = request.predict(Layout(dp=4, zero=0)).memory
    zero3 = request.predict(Layout(dp=4, zero=3)).memory
    assert zero0.model_state == pytest.approx(16 * zero0.params)
    assert zero3.model_state == pytest.approx(16 * zero3.params / 4)
    tp = request.predict(Layout(dp=2, tp=2)).memory
    sp = request.predict(Layout(dp=2, tp=2, sp=True)).memory
    cp = request.predict(Layout(dp=2, cp=2)).memory  # the same tokens per dp rank
    plain = plan_request(config(*SMALL), 2, "cpu", Space()).predict(Layout(dp=2)).memory
    assert sp.activations < tp.activations < plain.activations
    assert cp.activations == pytest.approx(plain.activations / 2)


def test_plan_prints_a_table_and_json(tmp_path):
    out = run_main("plan", *SMALL, "--world", 4, "--top", 3, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "valid layouts fit" in out.stdout and "run the best: meshwise train" in out.stdout
    out = run_main("plan", *SMALL, "--world", 4, "--json", cwd=tmp_path)
    rows = json.loads(out.stdout)
    assert {"layout", "peak_mem_bytes", "step_time_s", "tokens_per_s"} <= set(rows[0])
    assert rows[0]["tokens_per_s"] >= rows[-1]["tokens_per_s"]
    assert rows[0]["layout"].startswith("--dp ")


def test_explain_breaks_one_layout_down(tmp_path):
    out = run_main(
        "plan", *SMALL, "--world", 4, "--explain", "--dp 2 --tp 2 --zero 1", cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    for part in ("model state", "activations", "runtime", "tp comm", "dp comm", "optimizer"):
        assert part in out.stdout


def test_an_invalid_layout_is_refused_with_the_configuration_checks_words(tmp_path):
    out = run_main(
        "plan", "--model", "llama-small", "--world", 4, "--explain", "--tp 4", cwd=tmp_path
    )
    assert out.returncode == 2
    assert "--tp 4 cannot split the model's 2 key/value heads" in out.stderr
    assert out.stderr.count("\n") == 1


def test_an_unknown_device_lists_the_known_ones(tmp_path):
    out = run_main("plan", *SMALL, "--world", 4, "--device", "tpu9", cwd=tmp_path)
    assert out.returncode == 2
    assert "valid: cpu, h100, h200, a100" in out.stderr


def test_when_nothing_fits_the_smallest_memory_and_world_are_named(tmp_path):
    out = run_main(
        "plan",
        "--model",
        "llama-1b",
        "--seq-len",
        "2048",
        "--batch-size",
        "8",
        "--world",
        2,
        "--device",
        "h100",
        "--device-memory-gb",
        8,
        cwd=tmp_path,
    )
    assert out.returncode == 2
    assert "no layout of --world 2 fits 8.0 GiB per device" in out.stderr
    assert "--device-memory-gb" in out.stderr and "or --world " in out.stderr
    needed = float(out.stderr.split("--device-memory-gb ")[1].split()[0])
    world = int(out.stderr.split("or --world ")[1].split()[0])
    ok = run_main(
        "plan",
        "--model",
        "llama-1b",
        "--seq-len",
        "2048",
        "--batch-size",
        "8",
        "--world",
        2,
        "--device",
        "h100",
        "--device-memory-gb",
        needed + 0.1,
        "--top",
        1,
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr
    ok = run_main(
        "plan",
        "--model",
        "llama-1b",
        "--seq-len",
        "2048",
        "--batch-size",
        "8",
        "--world",
        world,
        "--device",
        "h100",
        "--device-memory-gb",
        8,
        "--top",
        1,
        cwd=tmp_path,
    )
    assert ok.returncode == 0, ok.stderr


def test_no_fit_raises_for_the_api_too():
    cfg = config("--model", "llama-1b", "--seq-len", "2048", "--batch-size", "8")
    with pytest.raises(NoLayoutFits):
        plan_request(cfg, 1, "h100", Space(), memory_gb=4).run()


LLAMA_70B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 8192,
    "intermediate_size": 28672,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
}


@pytest.mark.timeout(60)
def test_a_70b_model_on_1024_gpus_is_planned(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_70B))
    cfg = config(
        "--init-from", tmp_path, "--seq-len", 8192, "--batch-size", 1024, "--device", "h100"
    )
    assert cfg.runtime.dtype == "bf16"
    assert model_shape(cfg).num_params == pytest.approx(70.55e9, rel=0.01)
    ranked = plan_request(cfg, 1024, "h100", Space()).run()
    best = ranked[0]
    assert best.layout.world_size == 1024 and best.fits
    assert best.layout.tp in (1, 2, 4, 8)  # whole key/value heads per rank
    assert 0.3 < best.mfu < 0.6  # what dense 70B training reaches on H100s
    # the refined best agree with --explain's exact prediction
    again = plan_request(cfg, 1024, "h100", Space()).predict(best.layout)
    assert again.time.step == pytest.approx(best.time.step)


def test_the_cpu_profile_reads_a_stored_calibration(tmp_path):
    from meshwise.planner.devices import save_calibration

    save_calibration({"matmul_flops": {"fp32": 1e9, "bf16": 2e9}, "when": "now"}, tmp_path)
    profile = device_profile("cpu", tmp_path)
    assert profile.matmul_rate("fp32") == 1e9 and "calibrated here" in profile.source


def test_layout_auto_takes_the_planners_best_for_the_launched_world(tmp_path):
    from meshwise.cli.train import train_config

    flags = ["train", "--layout", "auto", "--dp", "4", *SMALL, "--cache-dir", str(tmp_path)]
    cfg, origins = train_config(build_parser().parse_args(flags))
    assert cfg.parallel.dims.world_size == 4 and origins["dp"] == "auto"
    request = plan_request(config(*SMALL), 4, "cpu", Space(), cache_dir=str(tmp_path))
    assert Layout.of(cfg) == request.run()[0].layout
    # a layout flag given with it narrows the choice
    cfg, _ = train_config(build_parser().parse_args([*flags, "--zero", "3"]))
    assert cfg.parallel.zero == 3 and cfg.parallel.dims.world_size == 4


def test_the_probes_measure_positive_rates():
    from meshwise.planner.probes import local_probes

    probes = local_probes()
    assert probes["matmul_flops"]["fp32"] > 1e8 and probes["matmul_flops"]["bf16"] > 1e7
    assert probes["memory_bandwidth"] > 1e8 and 0 < probes["op_overhead_s"] < 1e-3
    assert 0 < probes["optimizer_s_per_param"] < 1e-6 and probes["attention_efficiency"] > 0


def test_layout_auto_warns_of_nothing_it_set_itself(tmp_path):
    from meshwise.cli.train import train_config
    from meshwise.cli.unused_settings import noop_warnings

    flags = ["train", "--layout", "auto", "--dp", "2", *SMALL, "--cache-dir", str(tmp_path)]
    cfg, origins = train_config(build_parser().parse_args(flags))
    assert noop_warnings(cfg, origins) == []


def _tp_seconds(device, *flags) -> float:
    from dataclasses import replace as _replace

    from meshwise.planner.compute import action_costs
    from meshwise.planner.memory import Settings

    cfg = config(*SMALL)
    layout = _replace(Layout(), tp=2, **dict(flags))
    return action_costs(model_shape(cfg), layout, Settings(128, 8), device, 4, False, False).tp


def test_tp_collectives_are_counted_as_gloo_runs_them():
    # On gloo meshwise runs every gather and reduce-scatter as an all-reduce: --sp's 6
    # gathers and 4 reduce-scatters per layer cost 10 all-reduces, against 4 without it;
    # a recompute repeats one all-reduce (or two gathers and a reduce-scatter).
    from dataclasses import replace as _replace

    device = _replace(device_profile("cpu"), drift={})
    plain = _tp_seconds(device)
    assert _tp_seconds(device, ("sp", True)) == pytest.approx(10 / 4 * plain)
    assert _tp_seconds(device, ("activation_checkpointing", "full")) == pytest.approx(5 / 4 * plain)
    assert _tp_seconds(
        device, ("sp", True), ("activation_checkpointing", "selective")
    ) == pytest.approx(13 / 4 * plain)


def test_each_collective_waits_for_drifting_peers():
    from dataclasses import replace as _replace

    from meshwise.planner.collectives import sync_wait_s

    device = _replace(device_profile("cpu"), drift={2: 0.02, 4: 0.05})
    assert device.drift_at(1) == (0, 1) and device.drift_at(3) == (0.02, 2)
    assert device.drift_at(8) == (0.05, 4)
    # four collectives over 0.4 s: 0.02 x sqrt(0.1) each
    assert sync_wait_s(device, 2, 4, 0.4, 2) == pytest.approx(4 * 0.02 * 0.1**0.5)
    assert sync_wait_s(device, 1, 4, 0.4, 2) == 0
    # a pair of a 4-rank job on a CPU: the 4 ranks sharing the cores set the drift, and a
    # pair waits for the later of 2, not of 4 (expected maxima of normals: 0.564, 1.029)
    assert sync_wait_s(device, 2, 4, 0.4, 4) == pytest.approx(
        4 * 0.05 * 0.5642 / 1.0294 * 0.1**0.5, rel=1e-3
    )
    still = _replace(device, drift={})
    assert _tp_seconds(device) > _tp_seconds(still) > 0
