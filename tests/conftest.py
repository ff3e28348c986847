import os
import signal
from pathlib import Path

import pytest
import torch

from tests.dist.pool import Pools

# Every test that communicates holds the code to NCCL's rules, on gloo
# (``meshwise.comm.checks.strict``); spawned ranks and CLI runs inherit it. A test that
# measures gloo's own formulation (memory) unsets it for its runs.
os.environ.setdefault("MESHWISE_COMM_CHECK", "nccl")
# Processes the tests start import this checkout's meshwise, installed or not.
ROOT = str(Path(__file__).resolve().parents[1])
os.environ["PYTHONPATH"] = os.pathsep.join(
    [ROOT, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
)
# A suite started in the background of a non-interactive shell inherits SIGINT ignored, and
# so would every run it starts: the tests of Ctrl-C need Python's own handler.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
# This process's view of the GPUs, taken before any test hides them from its children.
GPUS = torch.cuda.device_count()


@pytest.fixture(autouse=True)
def cpu_unless_gpu_test(request, monkeypatch):
    """The CPU suite runs on the CPU on a GPU machine too, as in CI: the processes
    its tests start (CLI runs, rank pools) see no GPU, so ``--device auto`` and
    ``--dtype auto`` pick what CI picks. Only tests/gpu sees the GPUs."""
    if GPUS and Path(ROOT, "tests", "gpu") not in Path(str(request.node.path)).parents:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo rank pools shared by every distributed test:
    ``dist_pools.run(world_size, fn, *args)``."""
    pools = Pools()
    yield pools
    pools.close()
