"""Error paths that need no process group: each names its culprit."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from nn_handler import NullCommunicator
from nn_handler import distributed as nd
from nn_handler.data import gather_in_dataset_order, weighted_mean
from nn_handler.distributed.launcher import resolve_launch_backend
from nn_handler.distributed.parallel import select_devices
from nn_handler.errors import ConfigError


@pytest.mark.parametrize(
    ("kwargs", "culprit"),
    [
        ({"devices": []}, "at least one device"),
        ({"num_gpus": 3, "devices": ["cpu", "cpu"]}, "num_gpus=3 disagrees with 2 devices"),
        ({"num_gpus": 0}, "num_gpus must be a positive int"),
        ({"num_gpus": True}, "num_gpus must be a positive int"),
    ],
)
def test_device_selection_errors_name_the_argument(kwargs: dict, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        select_devices(**kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without CUDA")
def test_an_explicit_cuda_device_that_does_not_exist_names_the_count() -> None:
    with pytest.raises(ConfigError, match=r"cuda:0 does not exist: 0 CUDA device\(s\)"):
        select_devices(devices=["cuda:0"])


def test_an_unknown_launch_backend_is_named() -> None:
    with pytest.raises(ConfigError, match="backend='tcp'"):
        resolve_launch_backend("tcp", 2)
    with pytest.raises(ConfigError, match=r"unknown backend 'tcp'.*'cpu:gloo,cuda:nccl'"):
        nd.init_dist("tcp", rank=0, world_size=1)


def test_all_reduce_tensors_names_an_unsupported_op() -> None:
    nd.init_dist("gloo")
    try:
        with pytest.raises(ConfigError, match="unsupported op"):
            nd.all_reduce_tensors(torch.ones(1), op=dist.ReduceOp.BAND)
        with pytest.raises(ConfigError, match=r"unexpected keyword\(s\) \['tag'\]"):
            nd.gather_into_tensor(torch.ones(1), (1,), tag=1)
    finally:
        nd.shutdown_dist()


def test_exact_evaluation_helpers_reject_outputs_that_do_not_match() -> None:
    comm = NullCommunicator()
    with pytest.raises(ConfigError, match="has 2 rows but this rank visited 3 samples"):
        gather_in_dataset_order(torch.zeros(2), [0, 1, 2], comm)
    with pytest.raises(ConfigError, match=r"outputs\['p'\] has 1 rows"):
        gather_in_dataset_order({"p": torch.zeros(1)}, [0, 1], comm)
    with pytest.raises(ConfigError, match="a tensor or a dict of tensors"):
        gather_in_dataset_order([1, 2], [0, 1], comm)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"do not cover 0\.\.2 exactly once"):
        gather_in_dataset_order(torch.zeros(2), [0, 1], comm, total=3)
    ordered = gather_in_dataset_order(torch.tensor([10, 20]), [1, 0], comm, total=2)
    assert ordered.tolist() == [20, 10]
    assert math.isnan(weighted_mean({"acc": 1.0}, 0, comm)["acc"]), "no samples anywhere: NaN"


def test_a_closed_handler_refuses_work_with_a_clear_error() -> None:
    """train() after close() gave torch's 'Default process group has not been initialized'
    in a group; in every world it is now one error naming the call and the fix."""
    import torch
    from torch import nn

    from nn_handler import HandlerClosedError, NNHandler
    from tests.training_helpers import mlp, regression_data

    config = {"trainer": {"progress_bar": False}}
    handler = NNHandler(mlp(), lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(),
                        config=config)  # fmt: skip
    handler.close()
    handler.close()  # idempotent
    data = regression_data()
    for call in (
        lambda: handler.train(data, epochs=1),
        lambda: handler.evaluate(data),
        lambda: handler.predict(data),
        lambda: handler.save("unused.pt"),
        lambda: handler.resume("unused.pt"),
    ):
        with pytest.raises(HandlerClosedError, match=r"handler\.\w+\(\) was called on a closed"):
            call()
