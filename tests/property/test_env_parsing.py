"""Property tests for parse_distributed_env and the SLURM list expansions."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from nn_handler.distributed.env import (
    DistributedInfo,
    expand_slurm_nodelist,
    expand_slurm_tasks_per_node,
    parse_distributed_env,
)
from nn_handler.errors import ConfigError


@st.composite
def layouts(draw: st.DrawFn) -> tuple[int, int, int, int]:
    """(nodes, per_node, node_rank, local_rank) of a homogeneous run."""
    nodes = draw(st.integers(1, 16))
    per_node = draw(st.integers(1, 8))
    return nodes, per_node, draw(st.integers(0, nodes - 1)), draw(st.integers(0, per_node - 1))


def torchrun_env(nodes: int, per_node: int, node: int, local: int, port: int) -> dict[str, str]:
    return {
        "RANK": str(node * per_node + local),
        "LOCAL_RANK": str(local),
        "WORLD_SIZE": str(nodes * per_node),
        "LOCAL_WORLD_SIZE": str(per_node),
        "GROUP_RANK": str(node),
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": str(port),
        "TORCHELASTIC_RUN_ID": "job",
    }


@given(layouts(), st.integers(1, 65535))
def test_torchrun_environment_round_trips(layout: tuple[int, int, int, int], port: int) -> None:
    nodes, per_node, node, local = layout
    info = parse_distributed_env(torchrun_env(nodes, per_node, node, local, port))
    assert info == DistributedInfo(
        local_rank=local,
        rank=node * per_node + local,
        local_world_size=per_node,
        world_size=nodes * per_node,
        node_rank=node,
        master_addr="10.1.2.3",
        master_port=port,
        launcher="torchrun",
    )


@given(layouts())
def test_plain_env_without_torchelastic_is_the_env_launcher(
    layout: tuple[int, int, int, int],
) -> None:
    nodes, per_node, node, local = layout
    env = torchrun_env(nodes, per_node, node, local, 29500)
    del env["TORCHELASTIC_RUN_ID"], env["GROUP_RANK"]
    info = parse_distributed_env(env)
    assert info.launcher == "env" and info.node_rank == node  # rank // LOCAL_WORLD_SIZE


@given(layouts(), st.integers(0, 10**6))
def test_slurm_environment_round_trips(layout: tuple[int, int, int, int], job_id: int) -> None:
    nodes, per_node, node, local = layout
    env = {
        "SLURM_PROCID": str(node * per_node + local),
        "SLURM_NTASKS": str(nodes * per_node),
        "SLURM_LOCALID": str(local),
        "SLURM_NODEID": str(node),
        "SLURM_TASKS_PER_NODE": f"{per_node}(x{nodes})",
        "SLURM_JOB_NODELIST": f"gpu[{1:03d}-{nodes:03d}]",
        "SLURM_JOB_ID": str(job_id),
    }
    info = parse_distributed_env(env)
    assert (info.rank, info.local_rank, info.world_size) == (
        node * per_node + local,
        local,
        nodes * per_node,
    )
    assert (info.local_world_size, info.node_rank) == (per_node, node)
    assert info.master_addr == "gpu001" and info.launcher == "slurm"
    assert info.master_port is not None and 12000 <= info.master_port < 32000
    explicit = parse_distributed_env({**env, "MASTER_ADDR": "head", "MASTER_PORT": "4000"})
    assert (explicit.master_addr, explicit.master_port) == ("head", 4000)


@given(st.integers(1, 64), st.data())
def test_rank_at_or_beyond_world_size_is_rejected(world: int, data: st.DataObject) -> None:
    rank = data.draw(st.integers(world, world + 100))
    with pytest.raises(ConfigError, match=f"RANK={rank} is not below WORLD_SIZE={world}"):
        parse_distributed_env({"RANK": str(rank), "WORLD_SIZE": str(world)})


@given(st.sampled_from(["RANK", "WORLD_SIZE"]), st.integers(0, 8))
def test_rank_and_world_size_must_come_together(present: str, value: int) -> None:
    missing = "WORLD_SIZE" if present == "RANK" else "RANK"
    with pytest.raises(ConfigError, match=f"{present}=.*{missing} is not"):
        parse_distributed_env({present: str(value)})


@given(
    st.sampled_from(["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_PORT"]),
    st.one_of(
        st.integers(-1000, -1).map(str),
        st.text(alphabet="abcxyz.-+ ", min_size=1, max_size=6),
        st.floats(0.1, 9.9).map(lambda f: f"{f:.2f}"),
        # int() reads these as numbers; an environment variable must be plain ASCII digits.
        st.integers(1, 9).map(lambda n: f"1_{n}"),
        st.sampled_from(["\u0661", "\uff11", "+1"]),
    ),
)
def test_negative_or_non_integer_values_name_the_variable(name: str, raw: str) -> None:
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    env[name] = raw
    with pytest.raises(ConfigError, match=name):
        parse_distributed_env(env)


@given(st.integers(1, 8), st.data())
def test_local_rank_at_or_beyond_local_world_size_is_rejected(
    local_world: int, data: st.DataObject
) -> None:
    local = data.draw(st.integers(local_world, local_world + 8))
    env = {
        "RANK": "0",
        "WORLD_SIZE": str(local_world + 16),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(local_world),
    }
    with pytest.raises(ConfigError, match=r"LOCAL_RANK=.*LOCAL_WORLD_SIZE"):
        parse_distributed_env(env)


@given(st.integers(0, 7), st.integers(1, 8))
def test_manual_arguments_round_trip_on_one_machine(rank: int, world: int) -> None:
    assume(rank < world)
    info = parse_distributed_env({}, rank=rank, world_size=world)
    assert (info.rank, info.world_size, info.local_rank, info.local_world_size) == (
        rank,
        world,
        rank,
        world,
    )
    assert info.launcher == "manual"


@given(st.one_of(st.tuples(st.integers(0, 4), st.none()), st.tuples(st.none(), st.integers(1, 4))))
def test_only_one_of_rank_and_world_size_is_a_value_error(pair: tuple[int | None, ...]) -> None:
    rank, world = pair
    with pytest.raises(ValueError, match="rank and world_size must be given together"):
        parse_distributed_env({}, rank=rank, world_size=world)


def test_manual_arguments_that_contradict_the_launcher_are_rejected() -> None:
    with pytest.raises(ConfigError, match="rank=1 was passed but the launcher set RANK='0'"):
        parse_distributed_env({"RANK": "0", "WORLD_SIZE": "2"}, rank=1, world_size=2)


def test_nothing_set_is_a_single_process() -> None:
    assert parse_distributed_env({}) == DistributedInfo()
    assert DistributedInfo() == DistributedInfo(0, 0, 1, 1)  # the seed's positional order


def test_local_rank_alone_is_rejected() -> None:
    with pytest.raises(ConfigError, match="LOCAL_RANK='1' is set but RANK and WORLD_SIZE"):
        parse_distributed_env({"LOCAL_RANK": "1"})


def test_slurm_without_ntasks_and_bad_node_ids_are_rejected() -> None:
    with pytest.raises(ConfigError, match="SLURM_NTASKS"):
        parse_distributed_env({"SLURM_PROCID": "0"})
    with pytest.raises(ConfigError, match="SLURM_NODEID=2 has no entry"):
        parse_distributed_env(
            {
                "SLURM_PROCID": "0",
                "SLURM_NTASKS": "4",
                "SLURM_NODEID": "2",
                "SLURM_TASKS_PER_NODE": "2(x2)",
            }
        )


# ---------------------------------------------------------------- SLURM hostlists

hosts_numbers = st.lists(st.integers(0, 999), min_size=1, max_size=12, unique=True)


def compress(prefix: str, numbers: list[int], width: int) -> str:
    """Write numbers as SLURM does: prefix[a-b,c,...], each zero-padded to ``width``."""
    runs: list[list[int]] = []
    for n in sorted(numbers):
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    parts = [
        str(lo).zfill(width) if lo == hi else f"{str(lo).zfill(width)}-{str(hi).zfill(width)}"
        for lo, hi in runs
    ]
    return f"{prefix}[{','.join(parts)}]"


def test_compress_helper_writes_ranges() -> None:
    assert compress("n", [7, 1, 2, 3], 2) == "n[01-03,07]"


@given(
    st.lists(
        st.tuples(st.sampled_from(["node", "gpu", "cn-", "a1b"]), hosts_numbers, st.integers(1, 4)),
        min_size=1,
        max_size=3,
    )
)
def test_nodelist_expansion_inverts_compression(groups: list[tuple[str, list[int], int]]) -> None:
    nodelist = ",".join(compress(prefix, numbers, width) for prefix, numbers, width in groups)
    expected = [
        f"{prefix}{str(n).zfill(width)}"
        for prefix, numbers, width in groups
        for n in sorted(numbers)
    ]
    assert expand_slurm_nodelist(nodelist) == expected


@given(st.lists(st.tuples(st.integers(1, 64), st.integers(1, 9)), min_size=1, max_size=6))
def test_tasks_per_node_expansion(runs: list[tuple[int, int]]) -> None:
    text = ",".join(f"{count}(x{repeat})" if repeat > 1 else str(count) for count, repeat in runs)
    assert expand_slurm_tasks_per_node(text) == [c for c, r in runs for _ in range(r)]


def test_nodelist_examples() -> None:
    assert expand_slurm_nodelist("node[01-04,07]") == [
        "node01",
        "node02",
        "node03",
        "node04",
        "node07",
    ]
    assert expand_slurm_nodelist("login1") == ["login1"]
    assert expand_slurm_nodelist("r[1-2]n[8-9]-ib") == ["r1n8-ib", "r1n9-ib", "r2n8-ib", "r2n9-ib"]


@pytest.mark.parametrize(
    ("nodelist", "culprit"),
    [
        ("node[01-04", "unclosed"),
        ("node01-04]", "unmatched"),
        ("node[4-1]", "backwards"),
        ("node[a-b]", "range 'a-b'"),
        ("node[[1]]", "nested"),
        ("a,,b", "empty host"),
    ],
)
def test_malformed_nodelists_are_config_errors(nodelist: str, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        expand_slurm_nodelist(nodelist)


@given(st.integers(65536, 10**6))
def test_master_port_beyond_tcp_range_is_rejected(port: int) -> None:
    with pytest.raises(ConfigError, match=f"MASTER_PORT={port} is not a TCP port"):
        parse_distributed_env({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": str(port)})


@pytest.mark.parametrize(
    ("fields", "culprit"),
    [
        ({"rank": 2, "world_size": 2}, "rank=2 is not below world_size=2"),
        ({"local_rank": 1, "local_world_size": 1}, "local_rank=1 is not below"),
        ({"local_world_size": 4, "world_size": 2}, "local_world_size=4 exceeds"),
        ({"world_size": 0}, "world_size=0 must be >= 1"),
        ({"rank": -1}, "rank=-1 must be >= 0"),
        ({"rank": True}, "rank must be an int"),
        ({"master_port": 0}, "master_port=0"),
    ],
)
def test_inconsistent_distributed_info_names_the_field(fields: dict, culprit: str) -> None:
    with pytest.raises(ConfigError, match=culprit):
        DistributedInfo(**fields)


def test_slurm_local_id_beyond_the_nodes_tasks_is_rejected() -> None:
    env = {"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "2"}
    with pytest.raises(ConfigError, match="SLURM_LOCALID=2 is not below the 2 tasks on node 0"):
        parse_distributed_env({**env, "SLURM_NTASKS_PER_NODE": "2"})
