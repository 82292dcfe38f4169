"""Cluster launchers that start one process per node and leave torchrun to the script.

Kubeflow Trainer (a TrainJob on JobSet; its PyTorch runtime) sets torchrun's own option
variables, ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR`` and
``PET_MASTER_PORT``, for a ``torchrun`` command to read. SkyPilot sets ``SKYPILOT_NODE_RANK``,
``SKYPILOT_NUM_NODES``, ``SKYPILOT_NODE_IPS`` (one per line, the head first) and
``SKYPILOT_NUM_GPUS_PER_NODE``. A script run under either *without* torchrun is one process per
node: ``torchrun_view`` gives the variables torchrun would give that process (rank = node
rank, world size = nodes, local rank 0 of 1, the master's address, port 29500 as torchrun's
default unless ``MASTER_PORT`` is set). On one node the script is a single process, as it
would be without the launcher. Pure: it reads the mapping it is given and never
writes ``os.environ``. More than one process per node needs torchrun (which reads the
``PET_*`` variables itself): a ConfigError says the command.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from nn_handler.distributed.slurm_lists import is_ascii_int
from nn_handler.errors import ConfigError

ClusterLauncher = Literal["kubeflow", "skypilot"]

#: torchrun's default --master-port, used when the launcher names none.
DEFAULT_MASTER_PORT = 29500


def torchrun_view(env: Mapping[str, str]) -> tuple[ClusterLauncher, dict[str, str]] | None:
    """('kubeflow' or 'skypilot', the torchrun variables of this one-process-per-node run),
    or None when neither launcher's variables are set, or they describe one process."""
    if "PET_NNODES" in env or "PET_NODE_RANK" in env:
        view = _kubeflow(env)
        return None if view is None else ("kubeflow", view)
    if "SKYPILOT_NODE_RANK" in env:
        view = _skypilot(env)
        return None if view is None else ("skypilot", view)
    return None


def _count(env: Mapping[str, str], name: str, minimum: int, hint: str) -> int:
    raw = env[name].strip()
    if not is_ascii_int(raw) or int(raw) < minimum:
        raise ConfigError(
            f"Environment variable {name}={env[name]!r} is not an integer >= {minimum}; {hint}"
        )
    return int(raw)


def _kubeflow(env: Mapping[str, str]) -> dict[str, str] | None:
    command = "start the script with `torchrun train.py`, which reads the PET_* variables"
    nodes = _count(env, "PET_NNODES", 1, f"elastic node counts (min:max) need torchrun: {command}.")
    node_rank = _count(env, "PET_NODE_RANK", 0, "it is the node's index in the job.")
    if node_rank >= nodes:
        raise ConfigError(
            f"PET_NODE_RANK={node_rank} is not below PET_NNODES={nodes}; check the TrainJob's "
            f"numNodes."
        )
    if nodes == 1:  # one machine: a plain single process, as without the launcher
        return None
    per_node = env.get("PET_NPROC_PER_NODE", "1").strip()
    if per_node != "1":
        raise ConfigError(
            f"PET_NPROC_PER_NODE={per_node!r}: more than one process per node (or one per "
            f"device) is torchrun's to start; {command} (one process per node runs without it)."
        )
    addr = env.get("MASTER_ADDR") or env.get("PET_MASTER_ADDR")
    if not addr:
        raise ConfigError(
            f"PET_NNODES={nodes} but neither PET_MASTER_ADDR nor MASTER_ADDR is set: the "
            f"ranks cannot find node 0. Set PET_MASTER_ADDR to node 0's host name."
        )
    port = env.get("MASTER_PORT") or env.get("PET_MASTER_PORT") or str(DEFAULT_MASTER_PORT)
    return _one_per_node(node_rank, nodes, addr, port)


def _skypilot(env: Mapping[str, str]) -> dict[str, str] | None:
    ips = [line.strip() for line in env.get("SKYPILOT_NODE_IPS", "").splitlines() if line.strip()]
    nodes = (
        _count(env, "SKYPILOT_NUM_NODES", 1, "it is the task's num_nodes.")
        if "SKYPILOT_NUM_NODES" in env
        else max(len(ips), 1)
    )
    node_rank = _count(env, "SKYPILOT_NODE_RANK", 0, "it is the node's index in the task.")
    if node_rank >= nodes:
        raise ConfigError(
            f"SKYPILOT_NODE_RANK={node_rank} is not below SKYPILOT_NUM_NODES={nodes}."
        )
    if nodes == 1:  # one machine: a plain single process, as without the launcher
        return None
    gpus = 0
    if env.get("SKYPILOT_NUM_GPUS_PER_NODE", "").strip():
        gpus = _count(env, "SKYPILOT_NUM_GPUS_PER_NODE", 0, "it is the GPUs of one node.")
    if gpus > 1:
        raise ConfigError(
            f"SKYPILOT_NUM_GPUS_PER_NODE={gpus}: one process per GPU is torchrun's to start. "
            f"In the task's run: torchrun --nnodes=$SKYPILOT_NUM_NODES --nproc-per-node="
            f"$SKYPILOT_NUM_GPUS_PER_NODE --node-rank=$SKYPILOT_NODE_RANK --master-addr="
            f'$(echo "$SKYPILOT_NODE_IPS" | head -n1) --master-port={DEFAULT_MASTER_PORT} '
            f"train.py"
        )
    if len(ips) != nodes:
        raise ConfigError(
            f"SKYPILOT_NODE_IPS lists {len(ips)} node(s) but SKYPILOT_NUM_NODES={nodes}: the "
            f"ranks cannot agree on the head node."
        )
    addr = env.get("MASTER_ADDR") or ips[0]
    port = env.get("MASTER_PORT") or str(DEFAULT_MASTER_PORT)
    return _one_per_node(node_rank, nodes, addr, port)


def _one_per_node(node_rank: int, nodes: int, addr: str, port: str) -> dict[str, str]:
    return {
        "RANK": str(node_rank),
        "WORLD_SIZE": str(nodes),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": str(node_rank),
        "MASTER_ADDR": addr,
        "MASTER_PORT": port,
    }


__all__ = ["DEFAULT_MASTER_PORT", "ClusterLauncher", "torchrun_view"]
