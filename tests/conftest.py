import os

import pytest

from tests.dist.pool import Pools

# Every test that communicates holds the code to NCCL's rules, on gloo
# (``meshwise.comm.strict``); spawned ranks and CLI runs inherit it. A test that
# measures gloo's own formulation (memory) unsets it for its runs.
os.environ.setdefault("MESHWISE_COMM_CHECK", "nccl")


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo rank pools shared by every distributed test: ``dist_pools.run(world_size, fn, *args)``."""
    pools = Pools()
    yield pools
    pools.close()
