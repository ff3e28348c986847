"""--dp-shard's bad values end `meshwise train` with exit 2 and one line, before any rank."""

import pytest

from tests.e2e.conftest import SMALL, run_main


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--dp", "4", "--dp-shard", "3"], "--dp-shard 3 does not divide dp = 4"),
        (
            ["--dp", "4", "--dp-shard", "2", "--ranks-per-node", "1"],
            "--dp-shard 2 puts a replica of 2 ranks across nodes of --ranks-per-node 1; "
            "valid: --dp-shard 1",
        ),
        (
            ["--dp", "4", "--dp-shard", "2", "--allreduce", "hierarchical"],
            "--allreduce hierarchical cannot serve the replicate group of --dp-shard",
        ),
    ],
)
def test_bad_dp_shard_exits_2_in_one_line(tmp_path, corpus, flags, message):
    result = run_main("train", *SMALL, "--data", corpus, *flags, cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
