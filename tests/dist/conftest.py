import numpy as np
import pytest


@pytest.fixture(scope="package", autouse=True)
def _pools_end_with_the_package(dist_pools):
    """The rank pools end with the last test here. Every test builds its own mesh and
    each gloo group keeps a thread polling its sockets: by the end a rank holds hundreds,
    which would take a share of the CPU from every test after these."""
    yield
    dist_pools.close()


@pytest.fixture(scope="module", autouse=True)
def _groups_end_with_the_file(dist_pools):
    """A file's gloo subgroups end with its last test (``Pools.end_subgroups``)."""
    yield
    dist_pools.end_subgroups()


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> str:
    """A token file of 20,000 random byte ids that the files' runs train on."""
    path = tmp_path_factory.mktemp("tokens") / "tokens.bin"
    np.random.default_rng(2).integers(0, 256, 20_000).astype(np.uint16).tofile(path)
    return str(path)
