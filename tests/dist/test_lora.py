"""LoRA on gloo ranks: an imported Hugging Face Llama fine-tuned from a PEFT adapter
(``--lora-from``, its B not zero so that every product counts) gives, step by step,
- on one process: PEFT + transformers + ``torch.optim.AdamW`` on the same batches, over
  20 steps;
- on dp, tp (with and without sp), pp, cp, dp x tp x pp and ZeRO-1/3 layouts: the
  one-process losses and gradient norms (bf16: to bf16's precision);
and the frozen weights are bitwise what the directory holds after training.
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.hf_llama import save_hf_llama

pytestmark = pytest.mark.timeout(240)

STEPS, SEQ, BATCH, LR, SEED, RANK, ALPHA = 4, 16, 4, 1e-2, 7, 4, 8.0
PEFT_STEPS = 20  # the one-process run against PEFT: the 20 steps
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
HF = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=256,
)
LAYOUTS = {
    "dp2": dict(dp=2),
    "tp2": dict(tp=2),
    "tp2 sp": dict(tp=2, sp=True),
    "pp2": dict(pp=2),
    "dp2 zero3": dict(dp=2, zero=3),
    "dp2 zero1 checkpointing": dict(dp=2, zero=1, activation_checkpointing="full"),
    "cp2": dict(cp=2),
    # tensor parallelism's split adapters, reduced over dp and sent on by pp
    "dp2 tp2 pp2": dict(dp=2, tp=2, pp=2),
}


def _base_and_adapter(root, model_type: str) -> None:
    """A Hugging Face model of ``model_type`` in ``root/base``, a PEFT adapter of it with
    random A and B in ``root/adapter``."""
    import peft

    base = save_hf_llama(root / "base", seed=3, model_type=model_type, **HF)
    config = peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=TARGETS, lora_dropout=0.0)
    model = peft.get_peft_model(base, config)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(11)
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    model.save_pretrained(root / "adapter")


@pytest.fixture(scope="module")
def run_dirs(tmp_path_factory):
    """A Hugging Face Llama and its PEFT adapter, tokens, and in ``qwen2/`` a Qwen2 (biases
    on q, k, v) and its adapter beside the same tokens."""
    pytest.importorskip("peft")
    root = tmp_path_factory.mktemp("lora")
    _base_and_adapter(root, "llama")
    np.random.default_rng(1).integers(0, 256, 20_000).astype(np.uint16).tofile(root / "tokens")
    (root / "qwen2").mkdir()
    _base_and_adapter(root / "qwen2", "qwen2")
    (root / "qwen2" / "tokens").symlink_to(root / "tokens")
    return root


def _config(root, layout: dict):
    from meshwise.train.config import TrainConfig
    from meshwise.train.init_from import apply_init_from
    from meshwise.train.lora_setup import apply_lora_from

    cfg = TrainConfig()
    cfg.model.init_from, cfg.lora.lora_from = str(root / "base"), str(root / "adapter")
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = str(root / "tokens"), SEQ, BATCH
    cfg.data.seed = SEED
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, LR
    cfg.optim.weight_decay = 0.0
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    for key, value in layout.items():
        sections = (cfg.runtime, cfg.parallel, cfg.data, cfg.checkpoint, cfg.optim)
        section = next(s for s in sections if hasattr(s, key))
        setattr(section, key, value)
    origins: dict = {}
    apply_init_from(cfg, origins)
    apply_lora_from(cfg, origins)
    return cfg.validate()


def _train(root, layout: dict, stop: int | None = None, resume: str | None = None):
    """(loss, grad norm) per step up to ``stop`` (default: the last) of a run of ``STEPS``
    steps, or ``layout``'s ``steps`` (saved there with ``save``); whether every frozen
    weight is still the file's; how many there are and the dtypes of the frozen weights
    and of the adapters' masters."""
    from meshwise.hf.llama_weights import LlamaWeights
    from meshwise.models.families import family
    from meshwise.train.trainer import Trainer

    cfg = _config(root, layout)
    stop = stop or cfg.optim.steps
    trainer = Trainer(cfg, cfg.data.path, resume)
    pm = trainer.parallel_model
    frozen = {n: p for n, p in pm.named_parameters() if not p.requires_grad}
    records = [trainer.train_step(step) for step in range(trainer.start_step + 1, stop + 1)]
    if layout.get("save"):
        trainer.checkpointer.save(stop)
    trainer.comm_stats.close()
    weights = LlamaWeights(cfg.model.init_from, family("llama").make_config(cfg.model.sizes(256)))
    if cfg.parallel.zero == 3:  # sharded by the engine, as the trained ones (none held whole)
        assert not frozen and trainer.frozen_bytes == 0
        frozen = trainer.engine.full_state_dict(frozen=True)
        assert frozen
    pieces = pm.pieces(list(frozen.items()))
    held = {n: p.detach() for n, p in frozen.items()}
    unchanged = all(
        torch.equal(p.reshape(-1), weights.read(pieces[n]).to(p.dtype)) for n, p in held.items()
    )
    dtypes = (
        ",".join(sorted({str(p.dtype) for p in held.values()})),  # the frozen weights'
        ",".join(sorted({str(f.master.dtype) for f in trainer.engine.flats})),  # AdamW's
    )
    facts = {"frozen": len(frozen), "dtypes": dtypes}
    return [(r["loss"], r["grad_norm"]) for r in records], unchanged, facts


def _peft_training(root, steps: int) -> list[tuple[float, float]]:
    """The same fine-tuning written with PEFT, transformers and torch's AdamW."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshwise.data.dataset import TokenDataset
    from meshwise.train.lr_schedule import lr_at

    base = AutoModelForCausalLM.from_pretrained(root / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, root / "adapter", is_trainable=True)
    trainable = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(trainable, lr=LR, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    dataset = TokenDataset(str(root / "tokens"), SEQ)
    out = []
    for step in range(1, steps + 1):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, LR, 1, steps)
        batch = dataset.global_batch(step, BATCH, SEED)  # (B, T + 1)
        logits = model(input_ids=batch[:, :-1]).logits  # (B, T, V)
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        opt.zero_grad()
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(trainable, max_norm=1.0)
        opt.step()
        out.append((loss.item(), norm.item()))
    return out


_ONE: dict = {}


def _one_process(dist_pools, root):
    if "run" not in _ONE:
        _ONE["run"] = dist_pools.run(1, _train, root, {})[0]
    return _ONE["run"]


def test_one_process_equals_peft_and_keeps_the_base(dist_pools, run_dirs):
    curve, unchanged, facts = dist_pools.run(1, _train, run_dirs, dict(steps=PEFT_STEPS))[0]
    assert unchanged and facts["frozen"] == 2 * 9 + 3  # every weight but the adapters
    want = _peft_training(run_dirs, PEFT_STEPS)
    for step, (got, ref) in enumerate(zip(curve, want, strict=True), 1):
        assert got == pytest.approx(ref, rel=1e-4), step


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_layout_trains_the_adapters_as_one_process(dist_pools, run_dirs, name):
    layout = LAYOUTS[name]
    want, _, _ = _one_process(dist_pools, run_dirs)
    world = int(np.prod([layout.get(a, 1) for a in ("dp", "tp", "pp", "cp")]))
    results = dist_pools.run(world, _train, run_dirs, layout)
    assert all(unchanged for _, unchanged, _ in results), name
    for step, (got, ref) in enumerate(zip(results[0][0], want, strict=True), 1):
        assert got == pytest.approx(ref, rel=1e-4), (name, step)


def test_bf16_trains_fp32_adapter_masters_and_two_ranks_match_one(dist_pools, run_dirs):
    """bf16 compute (frozen weights and gathered adapters), fp32 AdamW masters; ZeRO-3 at
    two ranks gives one rank's losses to bf16's precision."""
    bf16 = ("torch.bfloat16", "torch.float32")
    want, unchanged, facts = dist_pools.run(1, _train, run_dirs, dict(dtype="bf16"))[0]
    assert unchanged and facts["dtypes"] == bf16
    got, unchanged, facts = dist_pools.run(2, _train, run_dirs, dict(dtype="bf16", dp=2, zero=3))[0]
    assert unchanged and facts["dtypes"] == bf16
    fp32, _, _ = _one_process(dist_pools, run_dirs)
    for step, (row, ref, full) in enumerate(zip(got, want, fp32, strict=True), 1):
        assert row[0] == pytest.approx(ref[0], rel=1e-2), step
        assert row[0] == pytest.approx(full[0], rel=5e-2), step  # bf16 trains as fp32 does


def test_a_run_saved_at_dp2_resumes_at_tp2_as_the_uninterrupted_run(dist_pools, run_dirs, tmp_path):
    """The checkpoint holds the adapters and their AdamW state; the frozen weights are
    read again from --init-from on resume."""
    want, _, _ = _one_process(dist_pools, run_dirs)
    save = tmp_path / "run"
    save.mkdir()
    dist_pools.run(2, _train, run_dirs, dict(dp=2, zero=2, save=str(save)), 2)
    checkpoint = str(next(save.rglob("manifest.json")).parent)
    results = dist_pools.run(2, _train, run_dirs, dict(tp=2), STEPS, checkpoint)
    got, unchanged, _ = results[0]
    assert unchanged and len(got) == STEPS - 2
    for step, (row, ref) in enumerate(zip(got, want[2:], strict=True), 3):
        assert row == pytest.approx(ref, rel=1e-4), step


def _train_save_and_logits(root, layout: dict, save: str, ids: torch.Tensor):
    from meshwise.train.trainer import Trainer

    cfg = _config(root, {**layout, "save": save})
    trainer = Trainer(cfg, cfg.data.path)
    for step in range(1, STEPS + 1):
        trainer.train_step(step)
    trainer.checkpointer.save(STEPS)
    trainer.comm_stats.close()
    pm = trainer.parallel_model
    with torch.no_grad():
        return pm.full_logits(pm.chunks[0](ids))


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_an_exported_adapter_loads_into_peft_with_equal_logits(
    dist_pools, run_dirs, tmp_path, model_type
):
    """Trained at tp 2 (B split on column-parallel layers, A on row-parallel ones) from
    ``--lora-from``, saved, exported: PEFT's model of the adapter gives meshwise's logits,
    and so do the merged model transformers loads and the model generate samples from."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshwise.checkpoint.store import open_checkpoint
    from meshwise.serve.export import export_checkpoint
    from meshwise.serve.model import load_model

    run_dirs = run_dirs if model_type == "llama" else run_dirs / model_type
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(5))
    save = tmp_path / "run"
    save.mkdir()
    logits = dist_pools.run(2, _train_save_and_logits, run_dirs, dict(tp=2), str(save), ids)[0]
    export_checkpoint(save, tmp_path / "adapter", "peft")
    base = AutoModelForCausalLM.from_pretrained(run_dirs / "base", dtype=torch.float32)
    model = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        untrained = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(run_dirs / "base", dtype=torch.float32),
            run_dirs / "adapter",
        )(input_ids=ids).logits
    assert (want - untrained).abs().max() > 1e-3  # the exported adapter is the trained one
    torch.testing.assert_close(logits, want, atol=1e-5, rtol=0)
    export_checkpoint(save, tmp_path / "merged", "hf", merge_lora=True)
    with torch.no_grad():  # what generate samples from
        sampled = load_model(open_checkpoint(save))(ids)
    torch.testing.assert_close(sampled, want, atol=1e-5, rtol=0)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=ids).logits, want, atol=1e-5, rtol=0)


def _moe_losses(root, layout: dict):
    """A mixture of experts with adapters on its attention (experts frozen, split over ep)."""
    from meshwise.train.config import TrainConfig
    from meshwise.train.trainer import Trainer

    cfg = TrainConfig()
    model = dict(preset="llama-tiny", n_layer=2, d_model=32, n_head=2, n_kv_head=2)
    for key, value in {**model, "n_experts": 4, "moe_ffn_hidden_size": 16}.items():
        setattr(cfg.model, key, value)
    cfg.lora.lora_rank, cfg.lora.lora_targets = 4, "q_proj,v_proj,o_proj"
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = str(root / "tokens"), SEQ, BATCH
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = STEPS, 1, LR
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    for key, value in layout.items():
        setattr(cfg.parallel, key, value)
    trainer = Trainer(cfg.validate(), cfg.data.path)
    records = [trainer.train_step(step) for step in range(1, STEPS + 1)]
    trainer.comm_stats.close()
    return [(r["loss"], r["grad_norm"]) for r in records]


def test_adapters_beside_frozen_experts_split_over_ep(dist_pools, run_dirs):
    want = dist_pools.run(1, _moe_losses, run_dirs, {})[0]
    got = dist_pools.run(2, _moe_losses, run_dirs, dict(dp=2, ep=2))[0]
    for step, (row, ref) in enumerate(zip(got, want, strict=True), 1):
        assert row == pytest.approx(ref, rel=1e-4), step
