"""HSDP's mesh sizes (strategies/mesh.py): whatever is given, the result multiplies to the
world size, keeps every size that was given, and 'auto' for both shards inside a machine."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nn_handler.config.training import MeshSize
from nn_handler.errors import ConfigError
from nn_handler.strategies.mesh import mesh_shape

sizes = st.one_of(st.just("auto"), st.integers(1, 16))


@given(st.integers(1, 64), st.integers(1, 16), sizes, sizes)
def test_the_mesh_covers_the_world_or_the_error_says_why(
    world: int, local: int, replicate: MeshSize, shard: MeshSize
) -> None:
    try:
        copies, ranks = mesh_shape(world, local, replicate, shard)
    except ConfigError as error:
        assert str(world) in str(error)
        if isinstance(replicate, int) and isinstance(shard, int):
            assert replicate * shard != world
        return
    assert copies * ranks == world and copies >= 1 and ranks >= 1
    assert replicate in ("auto", copies) and shard in ("auto", ranks)
    if replicate == shard == "auto":
        assert ranks == local


@given(st.integers(1, 8), st.integers(1, 8))
def test_auto_shards_over_each_machine_and_replicates_across(machines: int, local: int) -> None:
    assert mesh_shape(machines * local, local, "auto", "auto") == (machines, local)
    assert mesh_shape(machines * local, local, machines, "auto") == (machines, local)
    assert mesh_shape(machines * local, local, "auto", local) == (machines, local)


def test_sizes_that_do_not_divide_the_world_are_refused() -> None:
    with pytest.raises(ConfigError, match="must equal the world size 6"):
        mesh_shape(6, 6, 4, "auto")
