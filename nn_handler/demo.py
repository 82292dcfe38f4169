"""The worker of ``nn-handler demo``: every rank reports where it is, then one all_gather.

Run by torchrun (``nn-handler demo`` starts it); each rank joins the group from torchrun's
variables through DistributedContext.
"""

from __future__ import annotations

import argparse
from datetime import timedelta

import torch
from torch.distributed.elastic.multiprocessing.errors import record

from nn_handler.config import DistributedConfig
from nn_handler.distributed.context import DistributedContext


@record  # torchrun's report then names the real exception of a failing rank
def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m nn_handler.demo")
    parser.add_argument("--backend", default="auto", choices=["auto", "gloo", "nccl"])
    args = parser.parse_args(argv)
    config = DistributedConfig(backend=args.backend, timeout=timedelta(seconds=60))
    with DistributedContext(config) as ctx:
        comm = ctx.communicator
        infos = comm.all_gather_object((ctx.info, str(ctx.device)))
        # A different length on every rank: the gather is exact, padding removed.
        gathered = comm.all_gather(torch.full((ctx.rank + 1,), ctx.rank, device=ctx.device))
        total = comm.all_reduce(ctx.rank)
        if ctx.is_main_process:
            print(f"nn_handler demo: {ctx.world_size} processes, backend {ctx.backend}")
            for rank, (info, device) in enumerate(infos):
                print(f"  rank {rank} on {device}: {info}")
            print(f"  all_gather (rank r sends r+1 copies of r): {[t.tolist() for t in gathered]}")
            print(f"  all_reduce (sum of ranks): {total}")


if __name__ == "__main__":
    main()
