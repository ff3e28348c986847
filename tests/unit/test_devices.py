"""Device helpers: nothing here may need an accelerator to run."""

import pytest
import torch

from meshwise.comm.devices import synchronize


def test_synchronize_is_a_no_op_on_cpu_and_rejects_unknown_devices():
    synchronize(torch.device("cpu"))
    synchronize("meta")
    with pytest.raises(ValueError, match="cannot wait for device"):
        synchronize("xla")
