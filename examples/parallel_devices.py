"""Seed 002's multi-device executors. With GPUs they use every GPU; on a CPU-only machine they
run once on the CPU (with a warning), and ParallelExecutor(devices=[...]) shows the
multi-process path on CPU processes.

    python examples/parallel_devices.py
"""

from __future__ import annotations

import warnings

import torch

from nn_handler.utils.ddp_decorators import (
    ParallelExecutor,
    parallel_on_all_devices,
    parallelize_on_gpus,
)


@parallelize_on_gpus()
def process_on_gpu(device: torch.device, data: torch.Tensor) -> torch.Tensor:
    return data.to(device) * 2  # executed once per GPU, in its own process


@parallelize_on_gpus()
def matrix_multiply(device: torch.device, size: int = 1000, iterations: int = 10) -> object:
    a = torch.randn(size, size, device=device)
    b = torch.randn(size, size, device=device) / size**0.5
    for _ in range(iterations):
        a = torch.matmul(a, b)
    return a.cpu().numpy()  # plain arrays travel back between processes easily


@parallel_on_all_devices
def my_model_forward(data_chunk: torch.Tensor) -> torch.Tensor:
    return data_chunk.sum(dim=1, keepdim=True) + torch.ones(1, device=data_chunk.device)


def heavy_computation(device: torch.device, data: torch.Tensor) -> torch.Tensor:
    return data.to(device) * 2


def main() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the no-GPU notice, expected here
        results = process_on_gpu(torch.tensor([1, 2, 3]))
        matrices = matrix_multiply(size=64, iterations=4)
    print(f"process_on_gpu: {[r.tolist() for r in results]}")
    print(f"matrix_multiply: {len(matrices)} result(s) of shape {matrices[0].shape}")
    full_batch = torch.randn(128, 10, device="cuda:0" if gpus else "cpu")
    print(f"my_model_forward: output of shape {tuple(my_model_forward(full_batch).shape)}")
    devices = [f"cuda:{i}" for i in range(min(gpus, 2))] if gpus >= 2 else ["cpu", "cpu"]
    with ParallelExecutor(devices=devices, timeout=120) as executor:
        results = executor.run(heavy_computation, torch.tensor([1, 2, 3]))
    print(f"ParallelExecutor on {devices}: {[r.tolist() for r in results]}")


if __name__ == "__main__":
    main()
