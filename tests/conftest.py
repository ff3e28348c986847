import pytest

from tests.dist.pool import Pools


@pytest.fixture(scope="session")
def dist_pools():
    """Gloo rank pools shared by every distributed test: ``dist_pools.run(world_size, fn, *args)``."""
    pools = Pools()
    yield pools
    pools.close()
