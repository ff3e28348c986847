from pathlib import Path

import pytest

from meshwise.cli import build_parser, config_from_args
from meshwise.train.config import COMPOSITIONS, TrainConfig, composition_table

README = Path(__file__).resolve().parents[2] / "README.md"


def parse(*argv):
    return config_from_args(build_parser().parse_args(["train", *argv]))


def test_readme_shows_the_table_the_check_uses():
    assert composition_table() in README.read_text()


@pytest.mark.parametrize("axes, example, stages", COMPOSITIONS)
def test_every_listed_composition_validates(axes, example, stages):
    for zero in (0, 1, 2, 3):
        argv = [*example.split(), "--zero", str(zero), "--batch-size", "16"]
        if zero in stages:
            parse(*argv)
        else:
            with pytest.raises(ValueError, match=f"--zero {zero} with --pp"):
                parse(*argv)


def test_no_flags_is_the_two_rank_demo():
    cfg = parse()
    assert (cfg.parallel.dp, cfg.parallel.tp, cfg.parallel.pp) == (2, 1, 1)
    assert cfg.model.preset == "tiny"


def test_toml_then_flags(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('dp = 1\nbatch-size = 32\n[optim]\nlr = 0.01\nsteps = 7\n')
    cfg = parse("--config", str(path), "--steps", "9")
    assert (cfg.parallel.dp, cfg.data.batch_size, cfg.optim.lr, cfg.optim.steps) == (1, 32, 0.01, 9)


def test_toml_unknown_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("batch_sise = 3\n")
    with pytest.raises(ValueError, match="unknown key 'batch_sise'"):
        parse("--config", str(path))


def test_pipeline_micro_batches_default_to_pp():
    cfg = parse("--pp", "4", "--dp", "1")
    assert cfg.parallel.num_micro_batches == 4
    assert TrainConfig().parallel.num_micro_batches == 1
