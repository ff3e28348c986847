from tests.e2e.conftest import corpus  # noqa: F401 - the CPU suite's small corpus fixture
