"""Seed 004's helios.core.distributed functions under torchrun (they work alone too).

torchrun --nproc-per-node=2 examples/helios_functions.py
python examples/helios_functions.py
"""

from __future__ import annotations

import torch

from nn_handler.distributed import (
    all_reduce_tensors,
    gather_into_tensor,
    get_dist_info,
    get_global_rank,
    get_local_rank,
    get_local_world_size,
    get_world_size,
    global_print,
    init_dist,
    is_dist_active,
    is_using_torchrun,
    local_print,
    safe_barrier,
    shutdown_dist,
)


def main() -> None:
    if is_using_torchrun():
        init_dist(backend="auto")  # nccl on GPUs, gloo here
    info = get_dist_info()
    global_print(f"torchrun: {is_using_torchrun()}, active: {is_dist_active()}, {info}")
    local_print(
        f"local rank {get_local_rank()} of {get_local_world_size()} on this machine "
        f"(global rank {get_global_rank()})"
    )
    if is_dist_active():
        world = get_world_size()
        rank = get_global_rank()
        total = all_reduce_tensors(torch.tensor([rank + 1.0]))
        stacked = gather_into_tensor(torch.full((2,), float(rank)), size=(world, 2))
        global_print(f"sum of rank+1 over {world} ranks: {total.item():g}")
        global_print(f"gathered into one tensor: {stacked.tolist()}")
        safe_barrier()
        shutdown_dist()
    else:
        global_print("one process: nothing to reduce")


if __name__ == "__main__":
    main()
