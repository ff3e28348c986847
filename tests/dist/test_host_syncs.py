"""A training step reads the device once: its metrics (DESIGN: no host sync inside a step).

On a GPU every read of a device value on the host (``.item()``, ``.tolist()``,
``.cpu()``, a Python comparison or ``float()`` of a tensor) waits for all the
work queued before it. CI has no GPU, so the reads are counted instead: the
tensor methods that would wait are wrapped on the training thread of each rank
during one steady-state step (after the first, which checks tensor-parallel
replicas once and learns the pipeline's activation shapes).
"""

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.timeout(120)

READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__")
LAYOUTS = {
    "dp2-zero1": dict(dp=2, zero=1),
    "dp2-zero3": dict(dp=2, zero=3),
    "tp2": dict(tp=2),
    "tp2-sp": dict(tp=2, sp=True),
    "cp2": dict(cp=2),
    "cp2-tp2-sp-dropout": dict(cp=2, tp=2, sp=True, dropout=0.1),
    "pp2": dict(pp=2, micro_batches=2),
    "dp2-pp2-zbv-zero3": dict(dp=2, pp=2, schedule="zbv", virtual_stages=2, micro_batches=2,
                              zero=3, n_layer=4),
    "dp2-pp2-zb-h1-zero3-reshard": dict(dp=2, pp=2, schedule="zb-h1", micro_batches=2, zero=3,
                                        reshard_after_forward=True),
    "dp2-pp2-zero2": dict(dp=2, pp=2, micro_batches=2, zero=2),
    "dp2-int8-ring": dict(dp=2, compress="int8", allreduce="ring"),
    "dp2-powersgd-zero2": dict(dp=2, compress="powersgd:2", zero=2, compress_warmup_steps=0),
    "dp2-topk-tree": dict(dp=2, compress="topk:0.1", allreduce="tree", compress_warmup_steps=0),
    # document masks: the ring's skipped blocks are decided from host arrays
    "cp2-document-mask": dict(cp=2, document_mask=True),
    "dp2-pp2-document-mask": dict(dp=2, pp=2, micro_batches=2, document_mask=True),
}


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    from meshwise.data.token_files import _write_meta

    path = tmp_path_factory.mktemp("syncs") / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint16).tofile(path)
    # Id 0 ends a document (for the document masks): as a tokenizer's end-of-text token.
    _write_meta(path, {"num_tokens": 20_000, "vocab_size": 256, "max_token": None,
                       "source": str(path), "dtype": "uint16",
                       "tokenizer": {"kind": "tokenizer.json", "digest": "syncs",
                                     "separator": [0], "end_of_text": 0}})
    return str(path)


def _reads_in_one_step(layout: dict, data_path: str) -> list[str]:
    import threading

    from meshwise.train.config import TrainConfig
    from meshwise.train.trainer import Trainer

    cfg = TrainConfig()
    cfg.model.n_layer, cfg.model.d_model, cfg.model.n_head = 2, 32, 2
    cfg.data.path, cfg.data.seq_len, cfg.data.batch_size = data_path, 16, 8
    cfg.optim.steps, cfg.runtime.device, cfg.runtime.quiet = 3, "cpu", True
    for key, value in layout.items():
        section = next(s for s in (cfg.comm, cfg.model, cfg.parallel, cfg.data)
                       if hasattr(s, key))
        setattr(section, key, value)
    trainer = Trainer(cfg.validate(), data_path)
    trainer.train_step(1)
    main, reads = threading.get_ident(), []
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(name, method):
        def read(self, *args, **kwargs):
            if threading.get_ident() == main:
                reads.append(name)
            return method(self, *args, **kwargs)
        return read

    for name, method in originals.items():
        setattr(torch.Tensor, name, counted(name, method))
    try:
        trainer.train_step(2)
    finally:
        for name, method in originals.items():
            setattr(torch.Tensor, name, method)
    trainer.comm_stats.close()
    return reads


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_a_step_reads_the_device_once(dist_pools, tokens, name):
    layout = LAYOUTS[name]
    world = layout.get("dp", 1) * layout.get("tp", 1) * layout.get("pp", 1) * layout.get("cp", 1)
    for reads in dist_pools.run(world, _reads_in_one_step, layout, tokens):
        assert reads == ["tolist"], reads


def _combine_mixed_kinds():
    from meshwise.comm import ops
    from meshwise.train.metrics import RankValues

    world = ops.world_group()
    values = RankValues("cpu")
    # A loss is a device tensor where it is computed, a plain 0 elsewhere.
    values.add("loss", torch.tensor(2.5) if world.rank == 0 else 0.0, "sum")
    values.add("peak", 10.0 * (world.rank + 1), "max")
    values.add("norm", torch.tensor(7.0), "first")
    return values.gather(world)


def test_gathered_values_line_up_whatever_their_kind(dist_pools):
    for combined in dist_pools.run(2, _combine_mixed_kinds):
        assert combined == {"loss": 2.5, "peak": 20.0, "norm": 7.0}
