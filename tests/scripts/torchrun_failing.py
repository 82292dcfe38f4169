"""Run under torchrun by tests (not by pytest): rank 1 raises inside a @record entry point."""

from __future__ import annotations

from nn_handler import record
from nn_handler.distributed import get_rank, init_dist, safe_barrier


@record
def main() -> None:
    init_dist("gloo")
    if get_rank() == 1:
        raise ValueError("deliberate failure on rank 1")
    safe_barrier()


if __name__ == "__main__":
    main()
