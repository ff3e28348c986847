"""Activation memory per rank falls with cp and with sp, measured from the process.

Each layout trains a Llama at 2048 tokens and at 64, batch 1; the activations a
rank holds are the difference of the two runs' peak resident sets (the worst
rank's, read from the operating system, glibc told to return freed memory),
which removes parameters, optimizer state and start-up. Context parallelism
divides them by cp (each rank holds 1/cp of every sequence; the ring keeps no
(T, T) scores); sequence parallelism divides by tp the part between the
tensor-parallel layers, as the per-layer formula of benchmarks/long_sequences.py
says (Korthikanti et al. 2022). The 8192-token figures of docs/long-sequences.md
come from that benchmark.
"""

import pytest

from benchmarks.long_sequences import activation_bytes
from tests.e2e.conftest import read_metrics, run_cli

H, KV_HEADS, HEADS, FFN, LAYERS, LONG = 256, 2, 4, 768, 4, 2048
MODEL = [
    "--model",
    "llama-tiny",
    "--n-layer",
    LAYERS,
    "--d-model",
    H,
    "--n-head",
    HEADS,
    "--n-kv-head",
    KV_HEADS,
    "--ffn-hidden-size",
    FFN,
    "--block-size",
    LONG,
    "--batch-size",
    1,
    "--steps",
    1,
    "--eval-batches",
    1,
    "--warmup-steps",
    0,
    "-q",
]
MEASURED = {"MALLOC_MMAP_THRESHOLD_": "65536", "MESHWISE_COMM_CHECK": None}  # gloo's own


def activations(tmp_path, corpus, name: str, layout: list) -> int:
    peaks = []
    for seq_len in (LONG, 64):
        metrics = tmp_path / f"{name}-{seq_len}.jsonl"
        result = run_cli(
            "train",
            *MODEL,
            *layout,
            "--seq-len",
            seq_len,
            "--data",
            corpus,
            "--metrics",
            metrics,
            cwd=tmp_path,
            env_extra=MEASURED,
        )
        assert result.returncode == 0, result.stderr
        peaks.append(read_metrics(metrics)[-1]["peak_rss_bytes"])
    return peaks[0] - peaks[1]


@pytest.mark.timeout(400)
def test_cp_and_sp_divide_the_activations_a_rank_holds(tmp_path, corpus):
    measured = {
        name: activations(tmp_path, corpus, name, layout)
        for name, layout in {
            "cp1": ["--dp", "1"],
            "cp2": ["--cp", "2"],
            "tp2": ["--tp", "2"],
            "tp2+sp": ["--tp", "2", "--sp"],
        }.items()
    }
    assert measured["cp2"] <= 0.6 * measured["cp1"], measured
    head_dim = H // HEADS
    formula = {
        sp: activation_bytes(LONG, LAYERS, H, KV_HEADS * head_dim, HEADS, FFN, 2, sp)
        for sp in (False, True)
    }
    # What the step holds besides the layers' saved activations (logits, backward's
    # transients) is not divided: a margin of 5 points over the formula's ratio.
    expected = formula[True] / formula[False]
    assert measured["tp2+sp"] <= (expected + 0.05) * measured["tp2"], (measured, expected)
