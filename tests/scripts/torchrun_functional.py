"""Run by tests/distributed/test_functional.py under the real torchrun (not by pytest).

Usage: torchrun --nproc-per-node=2 torchrun_functional.py {init_dist|initialize_ddp} OUTDIR
Every rank checks the functional API against the variables torchrun set, then writes one line.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

from nn_handler import distributed as nd
from nn_handler.utils.ddp import initialize_ddp


def main() -> None:
    entry, outdir = sys.argv[1], Path(sys.argv[2])
    if entry == "init_dist":
        nd.init_dist(backend="gloo")  # rank and world_size come from torchrun
    else:
        result = initialize_ddp()
        assert result is not None and result[0], result
    rank, local = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    info = nd.get_dist_info()
    assert info.launcher == "torchrun" and info.node_rank == 0
    assert nd.get_global_rank() == rank and nd.get_local_rank() == local
    gathered = nd.all_gather({"rank": rank})
    assert gathered == [{"rank": 0}, {"rank": 1}], gathered
    summed = nd.all_reduce_tensors(torch.tensor([1.0]))
    assert summed.item() == 2.0
    nd.safe_barrier()
    (outdir / f"rank{rank}.txt").write_text(
        f"rank={nd.get_rank()} local_rank={nd.get_local_rank()} "
        f"local_world={nd.get_local_world_size()} world={nd.get_world_size()} "
        f"torchrun={nd.is_using_torchrun()} ok"
    )
    nd.shutdown_dist()


if __name__ == "__main__":
    main()
