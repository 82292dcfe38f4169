"""A multi-machine job under torchrun: every rank reports where it is and joins collectives.

On each of two machines (here both on 127.0.0.1, as the test does):

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d \\
        --rdzv-endpoint=HEAD_HOST:29400 --rdzv-id=my-job examples/multinode_torchrun.py

Optional argument: a folder in which every rank writes one line describing itself.
"""

from __future__ import annotations

import sys
from pathlib import Path

from nn_handler import DistributedContext, TorchCommunicator, record


@record  # torchrun's error file then records the real exception of a failing rank
def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    with DistributedContext() as ctx:
        info = ctx.info
        ctx.create_local_process_group()  # one group per machine, from LOCAL_WORLD_SIZE
        from nn_handler.distributed import get_local_process_group

        local = TorchCommunicator(get_local_process_group())
        everyone = ctx.communicator.all_reduce(info.rank)  # 0 + 1 + ... + world_size - 1
        machine = local.all_gather_object(info.rank)  # the global ranks on this machine
        line = (
            f"rank={info.rank} local_rank={info.local_rank} node_rank={info.node_rank} "
            f"world_size={info.world_size} local_world_size={info.local_world_size} "
            f"machine_ranks={machine} sum_of_ranks={everyone} launcher={info.launcher}"
        )
        print(line, flush=True)
        if out is not None:
            (out / f"rank{info.rank}.txt").write_text(line)


if __name__ == "__main__":
    main()
