"""The Communicator contract: checks that hold for any backend and any world size.

Each check takes a communicator and asserts what every rank must see, computed from its rank and
the world size. ``run_all`` runs them in order: the tests call it with a NullCommunicator in
process and with TorchCommunicator on every rank of real gloo groups.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable

import numpy as np
import pytest
import torch

from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CollectiveMismatchError, ConfigError


def _triangle(w: int) -> int:
    return w * (w + 1) // 2


def check_all_reduce_tensor_ops(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    t = torch.tensor([r + 1.0, 2.0 * (r + 1)])
    before = t.clone()
    assert torch.equal(comm.all_reduce(t), torch.tensor([1.0, 2.0]) * _triangle(w))
    assert torch.equal(t, before), "all_reduce must not modify its input"
    assert torch.allclose(comm.all_reduce(t, "mean"), torch.tensor([1.0, 2.0]) * (w + 1) / 2)
    assert torch.equal(comm.all_reduce(t, "min"), torch.tensor([1.0, 2.0]))
    assert torch.equal(comm.all_reduce(t, "max"), torch.tensor([1.0, 2.0]) * w)
    assert comm.all_reduce(t, "product")[0].item() == math.factorial(w)
    assert comm.all_reduce(torch.tensor([r], dtype=torch.int32)).dtype == torch.int32


def check_all_reduce_async(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    t = torch.tensor([r + 1.0, -(r + 1.0)])
    first = comm.all_reduce_async(t, "max")
    second = comm.all_reduce_async(t)  # two in flight, waited in order
    t.fill_(99.0)  # the input was copied: changing it now cannot change the results
    assert torch.equal(first(), torch.tensor([float(w), -1.0]))
    assert torch.equal(second(), torch.tensor([1.0, -1.0]) * _triangle(w))
    try:
        comm.all_reduce_async(t, "mean")  # type: ignore[arg-type]
    except ConfigError as error:
        assert "mean" in str(error)
    else:
        raise AssertionError("all_reduce_async(op='mean') must be a ConfigError")


def check_all_reduce_in_place(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    t = torch.tensor([r + 1.0, 2.0])
    assert comm.all_reduce_(t) is t and t.tolist() == [_triangle(w), 2.0 * w]
    fresh = torch.tensor([r + 1.0, 2.0])
    assert comm.all_reduce_(fresh, "mean").tolist() == [(w + 1) / 2, 2.0]
    strided = torch.arange(6.0).reshape(2, 3).t() * (r + 1)  # not contiguous: one temporary
    assert torch.equal(comm.all_reduce_(strided, "max"), torch.arange(6.0).reshape(2, 3).t() * w)
    flags = torch.tensor([r == 0, False])
    assert comm.all_reduce_(flags).tolist() == [True, False], "bool: any rank set it"
    leaf = torch.ones(2, requires_grad=True)
    assert comm.all_reduce_(leaf).tolist() == [float(w)] * 2 and leaf.requires_grad
    with pytest.raises(ConfigError, match=r"all_reduce_.*int64"):
        comm.all_reduce_(torch.ones(2, dtype=torch.int64), "mean")


def check_all_reduce_numbers_and_nesting(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    total = comm.all_reduce(r + 1)
    assert total == _triangle(w) and isinstance(total, int)
    mean = comm.all_reduce(r + 1, "mean")
    assert mean == pytest.approx((w + 1) / 2) and isinstance(mean, float)
    big = comm.all_reduce(2**60 + r, "max")
    assert big == 2**60 + w - 1, "ints travel as int64, exactly"
    nested = {"loss": float(r), "parts": [torch.full((2, 2), float(r)), (r, True)]}
    out = comm.all_reduce(nested)
    assert set(out) == {"loss", "parts"} and isinstance(out["parts"][1], tuple)
    assert out["loss"] == pytest.approx(_triangle(w - 1))
    assert torch.equal(out["parts"][0], torch.full((2, 2), float(_triangle(w - 1))))
    assert out["parts"][1] == (_triangle(w - 1), w)
    flags = comm.all_reduce(torch.tensor([r == 0, True]))
    assert flags.dtype == torch.int64 and flags.tolist() == [1, w]


def check_broadcast(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    src = w - 1
    got = comm.broadcast(torch.full((3,), float(r)), src=src)
    assert torch.equal(got, torch.full((3,), float(src)))
    data = {"step": r * 10, "mask": torch.tensor([r % 2 == 0, True])}
    out = comm.broadcast(data, src=src)
    assert out["step"] == src * 10
    assert out["mask"].dtype == torch.bool and out["mask"].tolist() == [src % 2 == 0, True]


def check_all_gather_variable_first_dim(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    mine = torch.full((r, 3), float(r))  # rank 0 sends an empty (0, 3) tensor
    parts = comm.all_gather(mine)
    assert [tuple(p.shape) for p in parts] == [(i, 3) for i in range(w)]
    assert all(torch.equal(p, torch.full((i, 3), float(i))) for i, p in enumerate(parts))
    exact = comm.all_gather(torch.tensor([2**62 + r], dtype=torch.int64))
    assert [int(p.item()) for p in exact] == [2**62 + i for i in range(w)]
    scalars = comm.all_gather(torch.tensor(float(r)))
    assert [p.item() for p in scalars] == [float(i) for i in range(w)]
    bools = comm.all_gather(torch.tensor([r % 2 == 1]))
    assert [p.dtype for p in bools] == [torch.bool] * w
    merged = comm.gather_into_tensor(torch.arange(r + 1))
    assert merged.tolist() == [j for i in range(w) for j in range(i + 1)]


def check_gather(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    dst = w - 1
    parts = comm.gather(torch.full((r + 1,), r), dst=dst)
    if r == dst:
        assert [p.tolist() for p in parts] == [[i] * (i + 1) for i in range(w)]
    else:
        assert parts == []


def check_object_collectives(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    obj = {"rank": r, "name": "x" * (r * 100), "items": list(range(r)), "none": None}
    gathered = comm.all_gather_object(obj)
    assert [g["rank"] for g in gathered] == list(range(w))
    assert gathered[r] == obj
    assert comm.all_gather_object(lambda x: x + r)[0](1) == 1, "cloudpickle for lambdas"
    # Around the 16 KiB first round: frames that fit travel with the lengths, larger ones in a
    # second round; mixed sizes across ranks take the second round for all.
    for size in (16000, 16500):
        texts = comm.all_gather_object("y" * (size + 300 * r))
        assert texts == ["y" * (size + 300 * i) for i in range(w)], size
    dst = w - 1
    on_dst = comm.gather_object(("r", r), dst=dst)
    assert on_dst == ([("r", i) for i in range(w)] if r == dst else [])
    src = w - 1
    assert comm.broadcast_object({"cfg": r, "lr": 0.1} if r == src else None, src=src) == {
        "cfg": src,
        "lr": 0.1,
    }


def _rank_payload(r: int) -> dict[str, object]:
    """Tensors of every kind the fast route takes (and some it leaves to torch), and arrays."""
    base = torch.arange(12.0).reshape(3, 4) + r
    shared = torch.full((2,), float(r))
    return {
        "f32": base,
        "bf16": base.to(torch.bfloat16),
        "bool": base > 5,
        "complex": torch.complex(base, -base),
        "scalar": torch.tensor(r),
        "empty": torch.empty(0, 3, dtype=torch.int16),
        "transposed": base.t(),  # not contiguous
        "grad": torch.ones(2, requires_grad=True) * 1.0,  # not a leaf: torch's own route
        "param": torch.nn.Parameter(torch.full((2,), float(r))),
        "array": np.arange(5, dtype=np.float32) + r,
        "same_twice": [shared, shared],
    }


def check_objects_carry_tensors_and_arrays(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    gathered = comm.all_gather_object(_rank_payload(r))
    for rank, got in enumerate(gathered):
        want = _rank_payload(rank)
        for key in ("f32", "bf16", "bool", "complex", "scalar", "empty", "transposed"):
            assert got[key].dtype == want[key].dtype, key  # type: ignore[attr-defined]
            assert torch.equal(got[key], want[key]), key  # type: ignore[arg-type]
        assert isinstance(got["param"], torch.nn.Parameter)
        assert torch.equal(got["param"], want["param"])  # type: ignore[arg-type]
        assert got["grad"].requires_grad  # type: ignore[attr-defined]
        assert np.array_equal(got["array"], want["array"])  # type: ignore[arg-type]
        first, second = got["same_twice"]  # type: ignore[misc]
        assert first is second, "one object sent twice arrives as one object"
    if w > 1:  # received tensors are writable and independent of one another
        received = gathered[(r + 1) % w]
        received["f32"].add_(1)  # type: ignore[attr-defined]
        assert torch.equal(received["transposed"], _rank_payload((r + 1) % w)["transposed"])  # type: ignore[arg-type]
    on_dst = comm.gather_object({"t": torch.full((r + 1,), r)}, dst=0)
    if r == 0:
        assert [o["t"].tolist() for o in on_dst] == [[i] * (i + 1) for i in range(w)]
    got = comm.broadcast_object({"a": np.ones(3) * 7, "t": torch.ones(2)} if r == 0 else None)
    assert got["a"].tolist() == [7.0] * 3 and got["t"].tolist() == [1.0, 1.0]


def check_reduce_dict_propagates_nan_like_the_originals(comm: Communicator) -> None:
    """detectron2's reduce_dict is a plain mean: one rank's NaN or inf reaches the result."""
    r, w = comm.rank, comm.world_size
    values = {"loss": float("nan") if r == w - 1 else 1.0, "acc": float(r), "int": r}
    mean = comm.reduce_dict(values)
    assert list(mean) == ["acc", "int", "loss"]  # sorted, as detectron2's
    assert math.isnan(mean["loss"]) and mean["acc"] == pytest.approx((w - 1) / 2)
    assert mean["int"] == pytest.approx((w - 1) / 2)
    total = comm.reduce_dict({"x": float("inf") if r == 0 else 1.0}, average=False)
    assert total["x"] == float("inf")
    tensor = comm.reduce_dict({"t": torch.tensor([float(r), float("nan") if r == 0 else 0.0])})
    assert tensor["t"][0].item() == pytest.approx((w - 1) / 2)
    assert math.isnan(tensor["t"][1].item())


def check_reduce_dict_keeps_integers_in_a_sum(comm: Communicator) -> None:
    """detectron2's reduce_dict stacks the tensors: summed integer counts stay integers (a
    mean is floating)."""
    w = comm.world_size
    total = comm.reduce_dict({"n": torch.tensor(3), "k": torch.tensor([1, 2])}, average=False)
    assert total["n"].dtype == torch.int64 and int(total["n"]) == 3 * w, total
    assert total["k"].dtype == torch.int64 and total["k"].tolist() == [w, 2 * w], total
    assert comm.reduce_dict({"c": 2}, average=False) == {"c": 2 * w}
    mean = comm.reduce_dict({"n": torch.tensor(3)})
    assert mean["n"].is_floating_point() and float(mean["n"]) == 3.0, mean


def check_reduce_dict_keys_must_agree(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    # The same keys in another order are the same dict.
    ordered = {"b": 1.0, "a": 2.0} if r % 2 else {"a": 2.0, "b": 1.0}
    assert comm.reduce_dict(ordered, average=False) == {"a": 2.0 * w, "b": 1.0 * w}
    if w == 1:
        return
    with pytest.raises(CollectiveMismatchError) as info:
        comm.reduce_dict({"acc": 0.9} if r == 0 else {"loss": 2.5})
    message = str(info.value)
    assert "rank 0: reduce_dict(average=True, ignore_nan=False) {'acc': float}" in message
    assert "rank 1: reduce_dict(average=True, ignore_nan=False) {'loss': float}" in message
    with pytest.raises(CollectiveMismatchError):  # a key more on one rank
        comm.reduce_dict({"a": 1.0, **({"b": 2.0} if r == 0 else {})})
    assert comm.reduce_dict({"a": 1.0}, average=False) == {"a": float(w)}  # still aligned


def check_reduce_dict_nan_rule(comm: Communicator) -> None:
    r, w = comm.rank, comm.world_size
    values = {
        "acc": float(r),
        "loss": float("nan") if r == 0 else float(r),  # NaN on rank 0 only
        "all_nan": float("nan"),
        "tensor": torch.tensor([float(r), float("nan")]),
    }
    mean = comm.reduce_dict(values, ignore_nan=True)
    assert mean["acc"] == pytest.approx((w - 1) / 2)
    if w == 1:
        assert math.isnan(mean["loss"])
    else:  # the mean over the ranks that had a value: 1..w-1
        assert mean["loss"] == pytest.approx(w / 2)
    assert math.isnan(mean["all_nan"])
    assert mean["tensor"][0].item() == pytest.approx((w - 1) / 2)
    assert math.isnan(mean["tensor"][1].item())
    total = comm.reduce_dict(
        {"loss": float("nan") if r == 0 else 1.0}, average=False, ignore_nan=True
    )
    if w == 1:
        assert math.isnan(total["loss"]), "every rank NaN: the sum is NaN"
    else:
        assert total["loss"] == w - 1
    inf = comm.reduce_dict({"x": float("inf") if r == 0 else 1.0}, ignore_nan=True)
    assert inf["x"] == float("inf"), "infinities are ordinary values"


def check_seed_barrier_and_agreement(comm: Communicator) -> None:
    seed = comm.shared_random_seed()
    assert 0 <= seed < 2**31
    assert comm.all_gather_object(seed) == [seed] * comm.world_size
    comm.barrier()
    comm.barrier(timeout=30)
    comm.raise_if_any_failed(None, "a step that worked everywhere")


def check_bad_input_is_a_config_error_on_every_rank(comm: Communicator) -> None:
    w = comm.world_size
    cases: list[tuple[Callable[[], object], str]] = [
        (lambda: comm.all_reduce(torch.ones(1), "avg"), "op='avg'"),  # type: ignore[arg-type]
        (lambda: comm.all_reduce({"a": "text"}), "data['a'] is a str"),
        (lambda: comm.broadcast(torch.ones(1), src=w), f"src={w}"),
        (lambda: comm.gather(torch.ones(1), dst=-1), "dst=-1"),
        (lambda: comm.all_gather([1, 2]), "all_gather_object"),  # type: ignore[arg-type]
        (lambda: comm.reduce_dict([1.0]), "dict"),  # type: ignore[arg-type]
        (lambda: comm.barrier(timeout=0), "timeout"),
    ]
    for call, culprit in cases:
        with pytest.raises(ConfigError, match=culprit.replace("[", r"\[").replace("(", r"\(")):
            call()
    comm.barrier()  # the group is still aligned


CHECKS: list[Callable[[Communicator], None]] = [
    check_all_reduce_tensor_ops,
    check_all_reduce_async,
    check_all_reduce_in_place,
    check_all_reduce_numbers_and_nesting,
    check_broadcast,
    check_all_gather_variable_first_dim,
    check_gather,
    check_object_collectives,
    check_objects_carry_tensors_and_arrays,
    check_reduce_dict_propagates_nan_like_the_originals,
    check_reduce_dict_keeps_integers_in_a_sum,
    check_reduce_dict_keys_must_agree,
    check_reduce_dict_nan_rule,
    check_seed_barrier_and_agreement,
    check_bad_input_is_a_config_error_on_every_rank,
]


def run_all(comm: Communicator) -> list[str]:
    """Run every check; returns the names that ran (for the caller to assert on)."""
    for check in CHECKS:
        check(comm)
    return [check.__name__ for check in CHECKS]


def unpicklable() -> object:
    return threading.Lock()
