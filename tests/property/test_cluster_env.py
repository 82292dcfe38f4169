"""Kubeflow Trainer's PET_* and SkyPilot's SKYPILOT_* variables, run without torchrun: one
process per node, mapped as torchrun would (nn_handler/distributed/cluster_env.py)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nn_handler.distributed.cluster_env import DEFAULT_MASTER_PORT
from nn_handler.distributed.env import DistributedInfo, parse_distributed_env
from nn_handler.errors import ConfigError

nodes_and_rank = st.integers(2, 64).flatmap(lambda n: st.tuples(st.just(n), st.integers(0, n - 1)))


def kubeflow_env(nodes: int, node: int, port: int | None = 23456) -> dict[str, str]:
    env = {
        "PET_NNODES": str(nodes),
        "PET_NPROC_PER_NODE": "1",
        "PET_NODE_RANK": str(node),
        "PET_MASTER_ADDR": "job-node-0-0.job",
    }
    if port is not None:
        env["PET_MASTER_PORT"] = str(port)
    return env


def skypilot_env(nodes: int, node: int, gpus: int = 1) -> dict[str, str]:
    return {
        "SKYPILOT_NODE_RANK": str(node),
        "SKYPILOT_NUM_NODES": str(nodes),
        "SKYPILOT_NODE_IPS": "\n".join(f"10.0.0.{i + 1}" for i in range(nodes)) + "\n",
        "SKYPILOT_NUM_GPUS_PER_NODE": str(gpus),
    }


@given(nodes_and_rank, st.one_of(st.none(), st.integers(1, 65535)))
def test_kubeflow_one_process_per_node_is_rank_node_rank(
    layout: tuple[int, int], port: int | None
) -> None:
    nodes, node = layout
    info = parse_distributed_env(kubeflow_env(nodes, node, port))
    assert info == DistributedInfo(
        local_rank=0,
        rank=node,
        local_world_size=1,
        world_size=nodes,
        node_rank=node,
        master_addr="job-node-0-0.job",
        master_port=DEFAULT_MASTER_PORT if port is None else port,
        launcher="kubeflow",
    )


@given(nodes_and_rank, st.sampled_from([0, 1]))
def test_skypilot_one_process_per_node_meets_at_the_head_node(
    layout: tuple[int, int], gpus: int
) -> None:
    nodes, node = layout
    info = parse_distributed_env(skypilot_env(nodes, node, gpus))
    assert (info.launcher, info.rank, info.world_size, info.node_rank) == (
        "skypilot",
        node,
        nodes,
        node,
    )
    assert (info.local_rank, info.local_world_size) == (0, 1)
    assert (info.master_addr, info.master_port) == ("10.0.0.1", DEFAULT_MASTER_PORT)


def test_torchrun_inside_the_cluster_launcher_wins() -> None:
    env = {**skypilot_env(2, 1), **kubeflow_env(2, 1)}
    env.update(RANK="3", WORLD_SIZE="4", LOCAL_RANK="1", TORCHELASTIC_RUN_ID="x")
    assert parse_distributed_env(env).launcher == "torchrun"


def test_one_node_is_a_single_process_and_master_port_overrides() -> None:
    assert parse_distributed_env(kubeflow_env(1, 0)).launcher == "single"
    assert parse_distributed_env(skypilot_env(1, 0)).launcher == "single"
    # One machine with several devices, run with plain python: one process, as before.
    many = {**kubeflow_env(1, 0), "PET_NPROC_PER_NODE": "4"}
    assert parse_distributed_env(many).launcher == "single"
    assert parse_distributed_env(skypilot_env(1, 0, gpus=8)).launcher == "single"
    info = parse_distributed_env({**skypilot_env(2, 0), "MASTER_PORT": "8008"})
    assert info.master_port == 8008


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({**kubeflow_env(2, 0), "PET_NPROC_PER_NODE": "4"}, r"PET_NPROC_PER_NODE='4'.*torchrun"),
        ({**kubeflow_env(2, 0), "PET_NPROC_PER_NODE": "gpu"}, r"`torchrun train.py`"),
        ({**kubeflow_env(2, 0), "PET_NNODES": "1:4"}, r"PET_NNODES='1:4'.*elastic"),
        (kubeflow_env(2, 2), r"PET_NODE_RANK=2 is not below PET_NNODES=2"),
        ({**kubeflow_env(2, 0), "PET_MASTER_ADDR": ""}, r"neither PET_MASTER_ADDR"),
        (skypilot_env(2, 0, gpus=8), r"SKYPILOT_NUM_GPUS_PER_NODE=8.*--nproc-per-node"),
        ({**skypilot_env(2, 0), "SKYPILOT_NODE_IPS": "10.0.0.1"}, r"lists 1 node\(s\)"),
        ({**skypilot_env(2, 0), "SKYPILOT_NODE_RANK": "x"}, r"SKYPILOT_NODE_RANK='x'"),
        (skypilot_env(2, 2), r"SKYPILOT_NODE_RANK=2 is not below SKYPILOT_NUM_NODES=2"),
        ({**skypilot_env(2, 0), "SKYPILOT_NUM_NODES": "0"}, r"SKYPILOT_NUM_NODES='0'"),
    ],
)
def test_what_one_process_per_node_cannot_be_is_a_config_error(
    env: dict[str, str], message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_distributed_env(env)
