"""QLoRA (``--quantize-base nf4``) on gloo ranks: adapters trained beside NF4 frozen
weights give, at tp 2, dp 2 (ZeRO 0 and 3) and pp 2, the one-process losses and gradient
norms; every layout holds the same 4-bit codes, unchanged by training; a run saved at dp 2
with ZeRO-3 resumes at tp 2 (codes quantised again from the same base) as the
uninterrupted run; and the merged model that generate and export build is the dequantised
base plus the adapters.
"""

import pytest
import torch

pytestmark = pytest.mark.timeout(240)

STEPS, SEQ, BATCH, SEED = 4, 16, 4, 5
# rows of 128 and 128 values: whole 64-value blocks, also split in two by tp 2
MODEL = dict(preset="llama-tiny", n_layer=2, d_model=128, n_head=4, n_kv_head=2)
# ZeRO-3 shards the adapters and the full-precision frozen weights, never the NF4 codes
LAYOUTS = {
    "tp2": dict(tp=2),
    "dp2": dict(dp=2),
    "pp2": dict(pp=2),
    "dp2 zero3": dict(dp=2, zero=3),
}


def _config(tokens: str, layout: dict):
    from meshwise.train.config import TrainConfig

    cfg = TrainConfig()
    for key, value in {**MODEL, "ffn_hidden_size": 128}.items():
        setattr(cfg.model, key, value)
    cfg.lora.lora_rank, cfg.lora.lora_alpha, cfg.lora.quantize_base = 4, 8.0, "nf4"
    cfg.lora.lora_init = "gaussian"
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = tokens, SEQ, BATCH
    cfg.data.seed = SEED
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, 1e-2
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    for key, value in layout.items():
        section = next(s for s in (cfg.parallel, cfg.checkpoint) if hasattr(s, key))
        setattr(section, key, value)
    return cfg.validate()


def _codes(parallel_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    from meshwise.apply.nf4 import HELD_AS

    held = {}
    for i, chunk in enumerate(parallel_model.chunks):
        for path, module in chunk.named_modules():
            state = getattr(module, HELD_AS, None)
            if state is not None:
                held[f"{i}.{path}"] = (state.codes.clone(), state.absmax.clone())
    return held


def _train(tokens: str, layout: dict, stop: int = STEPS, resume: str | None = None, ids=None):
    """(loss, grad norm) per step to ``stop``, the number of NF4 weights, whether their
    codes and scales are as before training, and with ``ids`` the logits after it."""
    from meshwise.train.trainer import Trainer

    cfg = _config(tokens, layout)
    trainer = Trainer(cfg, cfg.data.path, resume)
    pm = trainer.parallel_model
    before = _codes(pm)
    records = [trainer.train_step(step) for step in range(trainer.start_step + 1, stop + 1)]
    if layout.get("save"):
        trainer.checkpointer.save(stop)
    trainer.comm_stats.close()
    after = _codes(pm)
    unchanged = before.keys() == after.keys() and all(
        torch.equal(a, b) for k in before for a, b in zip(before[k], after[k], strict=True)
    )
    logits = None
    if ids is not None:
        with torch.no_grad():
            logits = pm.full_logits(pm.chunks[0](ids))
    curve = [(r["loss"], r["grad_norm"]) for r in records]
    return curve, len(before), unchanged, logits


_ONE: dict = {}


def _one_process(dist_pools, tokens, tmp_path_factory):
    if "run" not in _ONE:
        save = tmp_path_factory.mktemp("qlora-one")
        ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
        run = dist_pools.run(1, _train, tokens, dict(save=str(save)), STEPS, None, ids)[0]
        _ONE["run"], _ONE["save"], _ONE["ids"] = run, save, ids
    return _ONE["run"]


def test_one_process_holds_every_linear_but_the_head_as_nf4_unchanged_by_training(
    dist_pools, tokens, tmp_path_factory
):
    curve, num_quantised, unchanged, _ = _one_process(dist_pools, tokens, tmp_path_factory)
    assert num_quantised == 2 * 7 and unchanged and len(curve) == STEPS


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_as_one_process(dist_pools, tokens, tmp_path_factory, name):
    want = _one_process(dist_pools, tokens, tmp_path_factory)[0]
    results = dist_pools.run(2, _train, tokens, LAYOUTS[name])
    assert all(unchanged for _, _, unchanged, _ in results), name
    for step, (got, ref) in enumerate(zip(results[0][0], want, strict=True), 1):
        assert got == pytest.approx(ref, rel=1e-4), (name, step)


def test_a_run_saved_at_dp2_zero3_resumes_at_tp2_as_the_uninterrupted_run(
    dist_pools, tokens, tmp_path_factory, tmp_path
):
    want = _one_process(dist_pools, tokens, tmp_path_factory)[0]
    dist_pools.run(2, _train, tokens, dict(dp=2, zero=3, save=str(tmp_path)), 2)
    checkpoint = str(next(tmp_path.rglob("manifest.json")).parent)
    got = dist_pools.run(2, _train, tokens, dict(tp=2), STEPS, checkpoint)[0][0]
    assert len(got) == STEPS - 2
    for step, (row, ref) in enumerate(zip(got, want[2:], strict=True), 3):
        assert row == pytest.approx(ref, rel=1e-4), step


def test_the_merged_model_is_the_dequantised_base_plus_the_adapters(
    dist_pools, tokens, tmp_path_factory
):
    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.serve.model import load_model

    logits = _one_process(dist_pools, tokens, tmp_path_factory)[3]
    with torch.no_grad():
        merged = load_model(open_checkpoint(_ONE["save"]))(_ONE["ids"])
    torch.testing.assert_close(merged, logits, atol=1e-5, rtol=0)
