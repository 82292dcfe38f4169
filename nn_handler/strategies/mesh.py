"""The FSDP2 device mesh: one dimension (FSDP over every rank) or two (HSDP: ``replicate``
copies, each sharded over ``shard`` ranks), sized by FsdpConfig; and where the shards may
live (``cpu_offload``)."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from nn_handler.config.training import FsdpConfig, MeshSize
from nn_handler.errors import ConfigError

#: The names of HSDP's mesh dimensions (outer: across copies, inner: inside one copy).
MESH_DIMS = ("replicate", "shard")


def mesh_shape(
    world: int, local_world: int, replicate: MeshSize, shard: MeshSize
) -> tuple[int, int]:
    """(replicate, shard) with ``replicate * shard == world``: a size given as 'auto' is
    world divided by the other; both 'auto': shard over one machine's ``local_world`` ranks,
    replicate across machines. ConfigError when the sizes do not multiply to ``world``."""
    if replicate == "auto" and shard == "auto":
        replicate, shard = world // local_world, local_world
        if local_world < 1 or replicate * shard != world:
            raise ConfigError(
                f"fsdp.replicate and fsdp.shard 'auto' shard over each machine's {local_world} "
                f"ranks, which does not divide the world of {world}; give the sizes."
            )
        return replicate, shard
    copies = world // int(shard) if replicate == "auto" else int(replicate)
    ranks = world // int(replicate) if shard == "auto" else int(shard)
    if copies * ranks != world:
        raise ConfigError(
            f"fsdp.replicate={replicate} x fsdp.shard={shard} must equal the world size "
            f"{world} (every rank holds one shard of one copy); choose sizes whose product is "
            f"{world}, or leave one of them 'auto'."
        )
    return copies, ranks


def check_cpu_offload(settings: FsdpConfig, device_type: str) -> None:
    """ConfigError for ``fsdp.cpu_offload`` on ranks whose device is the CPU."""
    if settings.cpu_offload and device_type == "cpu":
        raise ConfigError(
            "fsdp.cpu_offload moves the shards, gradients and optimizer state from the "
            "accelerator to CPU memory, and this run's device is the CPU already: leave "
            "cpu_offload off."
        )


def build_mesh(device_type: str, replicate: int, shard: int) -> DeviceMesh:
    """A 1-D mesh (``replicate == 1``: plain FSDP) or HSDP's 2-D ``replicate x shard`` mesh,
    in which ranks ``i*shard .. (i+1)*shard-1`` hold copy ``i``. Every rank must call this."""
    if replicate == 1:
        return init_device_mesh(device_type, (shard,))
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=MESH_DIMS)


__all__ = ["MESH_DIMS", "build_mesh", "check_cpu_offload", "mesh_shape"]
