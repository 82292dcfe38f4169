"""Where am I: parse a launcher's environment into a validated ``DistributedInfo``.

Everything here is pure: functions take the environment as a mapping and never touch sockets,
CUDA or ``os.environ`` (callers pass ``os.environ``). Precedence, first match wins:

1. manual: ``rank`` and ``world_size`` passed explicitly (both or neither);
2. torchrun / env: ``RANK`` and ``WORLD_SIZE`` set (``torchrun`` when ``TORCHELASTIC_RUN_ID`` is
   set too, otherwise a launcher that exports the same variables);
3. SLURM: ``SLURM_PROCID`` set (one task per process, started by ``srun``);
4. Kubeflow Trainer (``PET_*``) or SkyPilot (``SKYPILOT_*``) without torchrun: one process per
   node, mapped as torchrun would (cluster_env.py);
5. single process: none of the above.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from nn_handler.distributed.cluster_env import torchrun_view
from nn_handler.distributed.slurm_lists import (
    expand_slurm_nodelist,
    expand_slurm_tasks_per_node,
    is_ascii_int,
)
from nn_handler.errors import ConfigError

Launcher = Literal["single", "manual", "torchrun", "env", "slurm", "kubeflow", "skypilot"]

#: Variables torchrun sets in every worker (see torch.distributed.run's documentation).
TORCHRUN_VARIABLES = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
)

#: First port of the range from which a SLURM job without MASTER_PORT derives its port.
SLURM_PORT_BASE = 12000
SLURM_PORT_SPAN = 20000


@dataclass(frozen=True)
class DistributedInfo:
    """Who this process is in the run: validated, immutable, computed once.

    For two nodes with two processes each: ``rank`` is 0..3, ``local_rank`` is 0 or 1 on each
    node, ``local_world_size`` is 2 (processes on this node) and ``world_size`` is 4.
    The defaults describe a single process. Raises ``ConfigError`` when inconsistent.
    """

    local_rank: int = 0
    rank: int = 0
    local_world_size: int = 1
    world_size: int = 1
    node_rank: int = 0
    master_addr: str | None = None
    master_port: int | None = None
    launcher: Launcher = "single"

    def __post_init__(self) -> None:
        for name in ("local_rank", "rank", "local_world_size", "world_size", "node_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ConfigError(f"DistributedInfo.{name} must be an int, got {value!r}.")
        _check_min("world_size", self.world_size, 1)
        _check_min("local_world_size", self.local_world_size, 1)
        _check_min("rank", self.rank, 0)
        _check_min("local_rank", self.local_rank, 0)
        _check_min("node_rank", self.node_rank, 0)
        if self.rank >= self.world_size:
            raise ConfigError(
                f"rank={self.rank} is not below world_size={self.world_size}: ranks run from 0 "
                f"to world_size - 1. Check RANK/WORLD_SIZE (or the arguments you passed)."
            )
        if self.local_rank >= self.local_world_size:
            raise ConfigError(
                f"local_rank={self.local_rank} is not below local_world_size="
                f"{self.local_world_size}. Check LOCAL_RANK/LOCAL_WORLD_SIZE."
            )
        if self.local_world_size > self.world_size:
            raise ConfigError(
                f"local_world_size={self.local_world_size} exceeds world_size={self.world_size}. "
                f"Check LOCAL_WORLD_SIZE/WORLD_SIZE."
            )
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master_port={self.master_port} is not a TCP port (1..65535).")

    @property
    def is_distributed(self) -> bool:
        """True when more than one process takes part in the run."""
        return self.world_size > 1

    @property
    def is_main_process(self) -> bool:
        """True on global rank 0."""
        return self.rank == 0


def _check_min(name: str, value: int, minimum: int) -> None:
    if value < minimum:
        raise ConfigError(f"DistributedInfo.{name}={value} must be >= {minimum}.")


def _env_int(env: Mapping[str, str], name: str, minimum: int = 0) -> int:
    raw = env[name]
    text = raw.strip()
    try:
        # ASCII digits only: int() also takes '1_0' (as 10) and other scripts' digits.
        if not is_ascii_int(text.removeprefix("-")):
            raise ValueError(text)
        value = int(text)
    except ValueError:
        raise ConfigError(
            f"Environment variable {name}={raw!r} is not an integer; set it to an integer "
            f">= {minimum} or unset it."
        ) from None
    if value < minimum:
        raise ConfigError(
            f"Environment variable {name}={raw!r} must be >= {minimum}; fix or unset it."
        )
    return value


def _optional_env_int(env: Mapping[str, str], name: str, minimum: int = 0) -> int | None:
    return _env_int(env, name, minimum) if name in env else None


def _master(env: Mapping[str, str]) -> tuple[str | None, int | None]:
    addr = env.get("MASTER_ADDR") or None
    port = _optional_env_int(env, "MASTER_PORT", 1)
    if port is not None and port > 65535:
        raise ConfigError(f"Environment variable MASTER_PORT={port} is not a TCP port (1..65535).")
    return addr, port


def is_torchrun_env(env: Mapping[str, str]) -> bool:
    """True when ``env`` holds the variables torchrun sets in each worker."""
    return all(name in env for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"))


def parse_distributed_env(
    env: Mapping[str, str],
    *,
    rank: int | None = None,
    world_size: int | None = None,
    local_rank: int | None = None,
    local_world_size: int | None = None,
) -> DistributedInfo:
    """Parse ``env`` (and optional explicit values) into a validated ``DistributedInfo``.

    Raises ``ConfigError`` (a ``ValueError``) naming the variable or argument at fault when
    the input is inconsistent: only one of ``rank``/``world_size``, RANK without WORLD_SIZE,
    RANK >= WORLD_SIZE, negative or non-integer values, LOCAL_RANK >= LOCAL_WORLD_SIZE.
    """
    if (rank is None) != (world_size is None):
        raise ConfigError(
            f"rank and world_size must be given together (manual launch) or both omitted "
            f"(torchrun, SLURM); got rank={rank!r}, world_size={world_size!r}."
        )
    if rank is not None and world_size is not None:
        return _parse_manual(env, rank, world_size, local_rank, local_world_size)
    if "RANK" in env or "WORLD_SIZE" in env:
        return _parse_rank_env(env)
    if "LOCAL_RANK" in env:
        raise ConfigError(
            f"LOCAL_RANK={env['LOCAL_RANK']!r} is set but RANK and WORLD_SIZE are not. Launch "
            f"with torchrun (which sets all three), export RANK and WORLD_SIZE too, or unset "
            f"LOCAL_RANK for a single process."
        )
    if "SLURM_PROCID" in env:
        return _parse_slurm(env)
    view = torchrun_view(env)
    if view is not None:
        launcher, variables = view
        return replace(_parse_rank_env(variables), launcher=launcher)
    return DistributedInfo()


def _parse_manual(
    env: Mapping[str, str],
    rank: int,
    world_size: int,
    local_rank: int | None,
    local_world_size: int | None,
) -> DistributedInfo:
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{name} must be an int, got {value!r}.")
    if world_size < 1:
        raise ConfigError(f"world_size={world_size} must be >= 1.")
    if rank < 0:
        raise ConfigError(f"rank={rank} must be >= 0.")
    for env_name, value in (("RANK", rank), ("WORLD_SIZE", world_size)):
        if env_name in env and _env_int(env, env_name) != value:
            raise ConfigError(
                f"{env_name.lower()}={value} was passed but the launcher set {env_name}="
                f"{env[env_name]!r}. Under torchrun omit rank and world_size; otherwise unset "
                f"{env_name}."
            )
    # Without launcher variables a manual run is assumed to live on one machine.
    if local_rank is None:
        env_local = _optional_env_int(env, "LOCAL_RANK")
        local_rank = rank if env_local is None else env_local
    if local_world_size is None:
        env_local_size = _optional_env_int(env, "LOCAL_WORLD_SIZE", 1)
        local_world_size = world_size if env_local_size is None else env_local_size
    addr, port = _master(env)
    return DistributedInfo(
        local_rank=local_rank,
        rank=rank,
        local_world_size=local_world_size,
        world_size=world_size,
        node_rank=rank // local_world_size if local_world_size else 0,
        master_addr=addr,
        master_port=port,
        launcher="manual",
    )


def _parse_rank_env(env: Mapping[str, str]) -> DistributedInfo:
    if "RANK" not in env or "WORLD_SIZE" not in env:
        present, missing = ("RANK", "WORLD_SIZE") if "RANK" in env else ("WORLD_SIZE", "RANK")
        raise ConfigError(
            f"{present}={env[present]!r} is set but {missing} is not: a launcher must set both. "
            f"Launch with torchrun, export {missing}, or unset {present} for a single process."
        )
    world_size = _env_int(env, "WORLD_SIZE", 1)
    rank = _env_int(env, "RANK")
    if rank >= world_size:
        raise ConfigError(
            f"RANK={rank} is not below WORLD_SIZE={world_size}: ranks run from 0 to "
            f"WORLD_SIZE - 1. Fix the launcher's RANK/WORLD_SIZE."
        )
    local_rank = _optional_env_int(env, "LOCAL_RANK")
    local_world_size = _optional_env_int(env, "LOCAL_WORLD_SIZE", 1)
    if local_rank is None:
        local_rank = rank if local_world_size is None else rank % local_world_size
    if local_world_size is None:
        local_world_size = world_size
    if local_rank >= local_world_size:
        raise ConfigError(
            f"LOCAL_RANK={local_rank} is not below LOCAL_WORLD_SIZE={local_world_size}. Fix the "
            f"launcher's LOCAL_RANK/LOCAL_WORLD_SIZE."
        )
    if local_world_size > world_size:
        raise ConfigError(
            f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}. Fix the "
            f"launcher's LOCAL_WORLD_SIZE/WORLD_SIZE."
        )
    node_rank = _optional_env_int(env, "GROUP_RANK")
    if node_rank is None:
        node_rank = _optional_env_int(env, "NODE_RANK")
    if node_rank is None:
        node_rank = rank // local_world_size
    addr, port = _master(env)
    return DistributedInfo(
        local_rank=local_rank,
        rank=rank,
        local_world_size=local_world_size,
        world_size=world_size,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        launcher="torchrun" if "TORCHELASTIC_RUN_ID" in env else "env",
    )


def _parse_slurm(env: Mapping[str, str]) -> DistributedInfo:
    rank = _env_int(env, "SLURM_PROCID")
    if "SLURM_NTASKS" in env:
        world_size = _env_int(env, "SLURM_NTASKS", 1)
    elif "SLURM_NPROCS" in env:
        world_size = _env_int(env, "SLURM_NPROCS", 1)
    else:
        raise ConfigError(
            "SLURM_PROCID is set but SLURM_NTASKS is not. Start one task per process with srun "
            "(e.g. `srun --ntasks=4 python train.py`)."
        )
    if rank >= world_size:
        raise ConfigError(
            f"SLURM_PROCID={rank} is not below SLURM_NTASKS={world_size}; check the srun arguments."
        )
    local_rank = _optional_env_int(env, "SLURM_LOCALID") or 0
    node_rank = _optional_env_int(env, "SLURM_NODEID") or 0
    local_world_size = _slurm_local_world_size(env, node_rank, world_size)
    if local_rank >= local_world_size:
        raise ConfigError(
            f"SLURM_LOCALID={local_rank} is not below the {local_world_size} tasks on node "
            f"{node_rank} (SLURM_NTASKS_PER_NODE / SLURM_TASKS_PER_NODE)."
        )
    addr, port = _master(env)
    if addr is None:
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if nodelist:
            addr = expand_slurm_nodelist(nodelist)[0]
    if port is None and "SLURM_JOB_ID" in env:
        port = SLURM_PORT_BASE + _env_int(env, "SLURM_JOB_ID") % SLURM_PORT_SPAN
    return DistributedInfo(
        local_rank=local_rank,
        rank=rank,
        local_world_size=local_world_size,
        world_size=world_size,
        node_rank=node_rank,
        master_addr=addr,
        master_port=port,
        launcher="slurm",
    )


def _slurm_local_world_size(env: Mapping[str, str], node_rank: int, world_size: int) -> int:
    raw = env.get("SLURM_NTASKS_PER_NODE", "").strip()
    if is_ascii_int(raw):
        return _env_int(env, "SLURM_NTASKS_PER_NODE", 1)
    if "SLURM_TASKS_PER_NODE" in env:
        per_node = expand_slurm_tasks_per_node(env["SLURM_TASKS_PER_NODE"])
        if node_rank >= len(per_node):
            raise ConfigError(
                f"SLURM_NODEID={node_rank} has no entry in SLURM_TASKS_PER_NODE="
                f"{env['SLURM_TASKS_PER_NODE']!r} ({len(per_node)} nodes)."
            )
        return per_node[node_rank]
    return world_size


def master_endpoint(info: DistributedInfo) -> tuple[str, int] | None:
    """The (address, port) rendezvous endpoint when both are known, else None."""
    if info.master_addr and info.master_port:
        return info.master_addr, info.master_port
    return None


__all__ = [
    "DistributedInfo",
    "Launcher",
    "TORCHRUN_VARIABLES",
    "expand_slurm_nodelist",
    "expand_slurm_tasks_per_node",
    "is_torchrun_env",
    "master_endpoint",
    "parse_distributed_env",
]
