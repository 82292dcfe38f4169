"""GradientFiniteCheck: one fused check per device/dtype group, in the one-group fast path and
with several groups, and it forgets a hit once reported."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from nn_handler.training.nonfinite import BufferSnapshot, GradientFiniteCheck


def _params(*dtypes: torch.dtype) -> list[nn.Parameter]:
    params = [nn.Parameter(torch.zeros(3, dtype=dtype)) for dtype in dtypes]
    for param in params:
        param.grad = torch.ones_like(param)
    return params


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float32, torch.float64)])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_nonfinite_gradient_in_any_group_is_found_then_forgotten(
    dtypes: tuple[torch.dtype, ...], bad: float
) -> None:
    params = _params(*dtypes)
    check = GradientFiniteCheck(params)
    assert check.all_finite()
    params[-1].grad[1] = bad
    assert not check.all_finite()
    params[-1].grad = torch.ones_like(params[-1])
    assert check.all_finite(), "the hit of the previous call must not stick"
    assert torch.equal(params[0].grad, torch.ones(3, dtype=dtypes[0]))


@pytest.mark.parametrize("dtypes", [(torch.float32,), (torch.float32, torch.float64)])
def test_extra_tensors_join_the_check_and_missing_gradients_are_skipped(
    dtypes: tuple[torch.dtype, ...],
) -> None:
    params = _params(*dtypes)
    params[0].grad = None
    check = GradientFiniteCheck(params)
    assert check.all_finite([torch.tensor(0.5)])
    assert not check.all_finite([torch.tensor(0.5), torch.tensor(float("nan"))])
    assert check.all_finite([torch.tensor(0.5)])


def test_no_gradients_at_all_count_as_finite() -> None:
    params = _params(torch.float32)
    params[0].grad = None
    assert GradientFiniteCheck(params).all_finite()


def test_a_buffer_snapshot_puts_batchnorm_statistics_back() -> None:
    module = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    snapshot = BufferSnapshot(module)
    assert snapshot.has_buffers and not BufferSnapshot(nn.Linear(3, 4)).has_buffers
    before = {k: v.clone() for k, v in module.named_buffers()}
    snapshot.take()
    module(torch.full((5, 3), float("nan")))  # a NaN batch in training mode
    assert torch.isnan(module[1].running_mean).all() and module[1].num_batches_tracked == 1
    snapshot.restore()
    after = dict(module.named_buffers())
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert not snapshot.taken
    snapshot.restore()  # nothing taken: a no-op
    assert all(torch.equal(before[k], after[k]) for k in before)


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "per buffer"])
@pytest.mark.parametrize("skipped", [1.0, 0.0])
def test_restoring_on_the_device_selects_every_buffer_bit_for_bit(
    skipped: float, fused: bool
) -> None:
    # float32, float64, bfloat16, int64 (0-dim) and bool buffers, one not contiguous, some
    # NaN after the forward: where the flag is set, the snapshot comes back, bits and all;
    # where it is not, the buffers stay as the forward left them.
    module = nn.Sequential(
        nn.BatchNorm1d(4), nn.BatchNorm1d(4).double(), nn.BatchNorm1d(4).bfloat16()
    )
    module.register_buffer("mask", torch.tensor([True, False]))
    module.register_buffer("strided", torch.zeros(3, 2).t())
    snapshot = BufferSnapshot(module, fused=fused)
    for _ in range(2):  # the byte views are built once, then reused
        before = {k: v.clone() for k, v in module.named_buffers()}
        snapshot.take()
        module[0](torch.full((5, 4), float("nan")))
        module[1](torch.randn(5, 4, dtype=torch.float64))
        module[2](torch.randn(5, 4, dtype=torch.bfloat16))
        module.mask.logical_not_()
        module.strided.add_(float("nan"))
        forward = {k: v.clone() for k, v in module.named_buffers()}
        snapshot.restore_where(torch.tensor(skipped))
        expected = before if skipped else forward
        for key, value in module.named_buffers():
            assert _bytes(value) == _bytes(expected[key]), key
        assert not snapshot.taken


def _bytes(tensor: torch.Tensor) -> bytes:
    return bytes(tensor.contiguous().reshape(-1).view(torch.uint8).tolist())


class _Operations(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("layers", [1, 3, 9])
def test_the_fused_restore_is_four_kernels_however_many_buffers(layers: int) -> None:
    # CUDA's route (a kernel launch each): the flag as bytes, then one subtraction, one
    # multiplication and one addition over every buffer's bytes. Counted here on the CPU.
    module = nn.Sequential(*[nn.BatchNorm1d(4) for _ in range(layers)])
    snapshot = BufferSnapshot(module, fused=True)
    snapshot.take()
    snapshot.restore_where(torch.tensor(1.0))  # the byte views are built on the first call
    snapshot.take()
    flag = torch.tensor(1.0)
    with _Operations() as operations:
        snapshot.restore_where(flag)
    assert operations.names == ["_to_copy", "_foreach_sub", "_foreach_mul_", "_foreach_add_"]
    assert not BufferSnapshot(module).fused  # on a CPU a torch.where per buffer is faster


@pytest.mark.parametrize("dtypes", [(torch.float32,) * 2, (torch.float32, torch.float64)])
def test_the_device_flag_says_what_all_finite_says_and_is_new_each_time(
    dtypes: tuple[torch.dtype, ...],
) -> None:
    params = _params(*dtypes)
    check = GradientFiniteCheck(params)
    finite = check.found_nonfinite([torch.tensor(0.5)])
    assert finite.shape == () and finite.dtype == torch.float32 and float(finite) == 0.0
    params[-1].grad[0] = float("inf")
    found = check.found_nonfinite()
    assert float(found) == 1.0 and float(finite) == 0.0, "an earlier flag must not change"
    params[-1].grad = torch.ones_like(params[-1])
    assert float(check.found_nonfinite()) == 0.0
    assert float(check.found_nonfinite([torch.tensor(float("nan"))])) == 1.0
    params[0].grad = None
    params[-1].grad = None
    assert float(check.found_nonfinite()) == 0.0  # no gradients at all: finite
    assert float(GradientFiniteCheck([]).found_nonfinite([torch.tensor(float("inf"))])) == 1.0
