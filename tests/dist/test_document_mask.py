"""Document masks and supervised fine-tuning on gloo ranks, against independent references.

- ``--document-mask``: the trainer's first loss on tp 2 (+ sp), pp 2 (with activation
  checkpointing: a recompute reads its own micro-batch's documents) and cp 2
  (Llama: rotary positions; GPT: learned ones) equals a loss computed by hand
  from the plain single-process model run on each document of the batch alone,
  from position 0 (float64), and the next steps agree with one process;
- chat data: the first loss of a random Hugging Face Llama (``--init-from``)
  fine-tuned on packed conversations, on one process, dp 2 x tp 2 and pp 2,
  equals transformers' model of the same weights on the same rows, its
  cross-entropy taken over the assistant tokens only, found by transformers'
  own ``apply_chat_template`` (assistant masks from the template's
  ``{% generation %}`` blocks).
"""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.chat_data import chat_model_and_data, hf_reference

pytestmark = pytest.mark.timeout(240)

SEQ_LEN, BATCH, SEPARATOR = 32, 4, 0
LLAMA = dict(preset="llama-tiny", n_layer=2, d_model=64, n_head=4, n_kv_head=2,
             ffn_hidden_size=96)
GPT = dict(preset="tiny", n_layer=2, d_model=32, n_head=4)
LAYOUTS = {
    "llama tp2 sp": (LLAMA, dict(tp=2, sp=True)),
    # one row per micro-batch, recomputed in the backward: each its own documents
    "llama pp2 checkpointing": (LLAMA, dict(pp=2, micro_batches=4,
                                            activation_checkpointing="full")),
    "llama cp2": (LLAMA, dict(cp=2)),
    # a sliding window inside each document, over the ring's blocks
    "llama cp2 window": ({**LLAMA, "sliding_window": 6}, dict(cp=2)),
    "llama dp2 zero3": (LLAMA, dict(dp=2, zero=3)),  # each dp rank its rows' documents
    "gpt cp2 tp2 sp": (GPT, dict(cp=2, tp=2, sp=True)),
}


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    """Tokens 1..255 in documents of 2 to 40 tokens, each ended by id 0 (end of text)."""
    from meshwise.data.token_files import _write_meta

    rng = np.random.default_rng(4)
    parts = []
    while sum(map(len, parts)) < 6000:
        parts.append(np.append(rng.integers(1, 256, rng.integers(2, 40)), SEPARATOR))
    tokens = np.concatenate(parts).astype(np.uint16)
    path = tmp_path_factory.mktemp("docs") / "docs.bin"
    tokens.tofile(path)
    _write_meta(path, {"num_tokens": len(tokens), "vocab_size": 256, "max_token": None,
                       "source": str(path), "dtype": "uint16",
                       "tokenizer": {"kind": "tokenizer.json", "path": None, "digest": "docs",
                                     "vocab_size": 256, "separator": [SEPARATOR],
                                     "end_of_text": SEPARATOR}})
    return str(path)


def _config(model: dict, layout: dict, data_path: str, steps: int, **data):
    from meshwise.train.config import TrainConfig

    cfg = TrainConfig()
    for key, value in model.items():
        setattr(cfg.model, key, value)
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, SEQ_LEN, BATCH
    for key, value in data.items():
        setattr(cfg.data, key, value)
    cfg.optim.steps, cfg.optim.warmup_steps, cfg.optim.lr = steps, 1, 3e-3
    cfg.runtime.device, cfg.runtime.quiet = "cpu", True
    for key, value in layout.items():
        setattr(cfg.runtime if hasattr(cfg.runtime, key) else cfg.parallel, key, value)
    return cfg


def _train(cfg, data_path: str) -> list[float]:
    from meshwise.train.init_from import apply_init_from
    from meshwise.train.trainer import Trainer

    apply_init_from(cfg, {})
    trainer = Trainer(cfg.validate(), data_path)
    records = [trainer.train_step(step) for step in range(1, cfg.optim.steps + 1)]
    trainer.comm_stats.close()
    return [r["loss"] for r in records]


def _each_document_alone(model: dict, data_path: str) -> float:
    """Step 1's mean token loss: the plain model on every document of the batch alone."""
    from meshwise.data.batches import BatchSource
    from meshwise.data.dataset import TokenDataset
    from meshwise.models.families import family

    cfg = _config(model, {}, data_path, 1, document_mask=True).validate()
    fam = family(cfg.model.family)
    plain = fam.create(fam.make_config(cfg.model.sizes(256)), seed=cfg.data.seed).double()
    rows = BatchSource(TokenDataset(data_path, SEQ_LEN)).batch(1, BATCH, cfg.data.seed).tokens
    total = 0.0
    with torch.no_grad():
        for row in rows:
            inputs, targets = row[:-1], row[1:]
            ends = (torch.nonzero(inputs == SEPARATOR).flatten() + 1).tolist()
            for start, end in zip([0] + ends, ends + [SEQ_LEN]):
                if start < end:
                    logits = plain(inputs[None, start:end])[0]
                    total += F.cross_entropy(logits, targets[start:end], reduction="sum").item()
    return total / (BATCH * SEQ_LEN)


_ONE_PROCESS: dict = {}


def _one_process(dist_pools, model: dict, data_path: str) -> tuple[list[float], float]:
    """One process's masked losses and its unmasked first loss (once per model)."""
    key = tuple(sorted(model.items()))
    if key not in _ONE_PROCESS:
        masked = dist_pools.run(1, _train, _config(model, {}, data_path, 2, document_mask=True),
                                data_path)[0]
        plain = dist_pools.run(1, _train, _config(model, {}, data_path, 1), data_path)[0]
        _ONE_PROCESS[key] = masked, plain[0]
    return _ONE_PROCESS[key]


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_document_masked_training_equals_each_document_alone(dist_pools, documents, name):
    model, layout = LAYOUTS[name]
    world = int(np.prod([layout.get(axis, 1) for axis in ("dp", "tp", "pp", "cp")]))
    got = dist_pools.run(world, _train, _config(model, layout, documents, 2,
                                                document_mask=True), documents)[0]
    assert got[0] == pytest.approx(_each_document_alone(model, documents), rel=1e-5), name
    one, unmasked = _one_process(dist_pools, model, documents)
    assert got == pytest.approx(one, rel=1e-5), name
    assert abs(unmasked - got[0]) > 1e-3  # the mask changes what is computed


# ---------------------------------------------------------------- fine-tuning
@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    """A random HF Llama with the chat tokenizer beside it, and a chat token file."""
    from meshwise.data.chat_files import build_chat_file
    from meshwise.data.chat_templates import load_template
    from meshwise.data.tokenizer import load_tokenizer

    root = tmp_path_factory.mktemp("sft")
    hf_dir, chats = chat_model_and_data(root)
    tokenizer = load_tokenizer(hf_dir)
    build_chat_file(root / "chat.bin", root / "chat.jsonl", tokenizer,
                    load_template(None, tokenizer.path))
    return hf_dir, str(root / "chat.bin"), chats


def _sft_batch(chat_bin: str, seq_len: int, seed: int) -> torch.Tensor:
    from meshwise.data.batches import BatchSource
    from meshwise.data.dataset import TokenDataset

    return BatchSource(TokenDataset(chat_bin, seq_len)).batch(1, 8, seed).tokens


@pytest.mark.parametrize("layout", [{}, dict(dp=2, tp=2), dict(pp=2)],
                         ids=["one process", "dp2 tp2", "pp2"])
def test_fine_tuning_loss_is_transformers_over_assistant_tokens(dist_pools, chat, layout):
    hf_dir, chat_bin, chats = chat
    cfg = _config({}, layout, chat_bin, 1)
    cfg.model.init_from, cfg.data.seq_len, cfg.data.batch_size = str(hf_dir), 128, 8
    world = int(np.prod(list(layout.values()) or [1]))
    got = dist_pools.run(world, _train, cfg, chat_bin)[0]
    want = hf_reference(hf_dir, _sft_batch(chat_bin, 128, cfg.data.seed), chats)
    assert got[0] == pytest.approx(want, rel=1e-5)
