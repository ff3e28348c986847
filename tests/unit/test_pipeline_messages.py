"""Pipeline messages in one process: headers, released activations, and the runtime on one rank."""

import pytest
import torch

from meshwise.comm.tensor_meta import MAX_DIMS, MESSAGE_LEN, TensorMeta
from meshwise.pipeline.p2p import release_storage
from meshwise.pipeline.runtime import PipelineRuntime
from meshwise.pipeline.schedules import build_schedule
from tests.dist.test_pipeline_runtime import (
    DT,
    ROWS,
    NoSyncEngine,
    T,
    _batch,
    _reference,
    _stages,
    loss_fn,
)


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((), torch.float32),
        ((7,), torch.bfloat16),
        ((2, 3, 4), torch.float64),
        ((1,) * MAX_DIMS, torch.int64),
        ((0, 5), torch.bool),
    ],
)
def test_header_round_trip(shape, dtype):
    meta = TensorMeta(shape, dtype)
    message = meta.to_message(torch.device("cpu"))
    assert message.shape == (MESSAGE_LEN,) and message.dtype == torch.int64
    assert TensorMeta.from_message(message) == meta
    assert meta.empty(torch.device("cpu")).shape == shape


def test_header_limits_are_clear_errors():
    with pytest.raises(ValueError, match="at most 8 dims"):
        TensorMeta((1,) * (MAX_DIMS + 1), torch.float32).to_message(torch.device("cpu"))
    with pytest.raises(ValueError, match="dtype torch.float8_e4m3fn"):
        TensorMeta((2,), torch.float8_e4m3fn).to_message(torch.device("cpu"))
    with pytest.raises(RuntimeError, match="out of step"):
        TensorMeta.from_message(torch.arange(MESSAGE_LEN))


@pytest.mark.parametrize("last", [torch.tanh, lambda h: h + 1.0])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_released_output_still_backpropagates(last, dtype):
    """tanh saves its output, ``+ 1`` saves nothing: both give the same gradients."""
    w = torch.randn(6, 6, dtype=dtype, requires_grad=True)
    x = torch.randn(4, 6, dtype=dtype)
    grad = torch.randn(4, 6, dtype=dtype)
    expected = torch.autograd.grad(last(x @ w), w, grad)[0]
    out = last(x @ w)
    release_storage(out)
    assert out.shape == (4, 6) and out.untyped_storage().nbytes() == out.element_size()
    torch.autograd.backward(out, grad)
    torch.testing.assert_close(w.grad, expected, rtol=0, atol=0)


@pytest.mark.parametrize("kind, num_virtual", [("gpipe", 1), ("interleaved-1f1b", 3)])
def test_runtime_on_one_rank_hands_off_locally(kind, num_virtual):
    """S == 1: chunks pass activations locally; same loss and gradients as one process."""
    stages, ref_stages = _stages(num_virtual, "not-3d"), _stages(num_virtual, "not-3d")
    runtime = PipelineRuntime(
        stages, build_schedule(kind, 1, 2, num_virtual), None, NoSyncEngine(), loss_fn=loss_fn
    )
    micro_batches, scale = _batch(2), 1.0 / (2 * ROWS * T)
    loss = runtime.run(micro_batches, scale)
    torch.testing.assert_close(loss, _reference(ref_stages, micro_batches, scale))
    for p, ref in zip(
        (p for s in stages for p in s.parameters()),
        (p for s in ref_stages for p in s.parameters()),
        strict=True,
    ):
        torch.testing.assert_close(p.grad, ref.grad, rtol=1e-12, atol=1e-14)
    assert loss.dtype == DT and loss.dim() == 0


def test_loss_fn_must_return_a_scalar():
    stages = _stages(1, "3d-fp64")
    runtime = PipelineRuntime(
        stages,
        build_schedule("gpipe", 1, 1),
        None,
        NoSyncEngine(),
        loss_fn=lambda out, targets: out.sum(-1),
    )
    with pytest.raises(ValueError, match=r"loss_fn must return a 0-dim tensor .* got \(2, 3\)"):
        runtime.run(_batch(1), 1.0)
