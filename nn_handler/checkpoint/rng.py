"""Random-number-generator states as plain values (tensors, ints, tuples) that load under
``weights_only=True``: torch CPU, every CUDA device, Python's ``random`` and NumPy's global."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def capture_rng() -> dict[str, Any]:
    """This process's generator states."""
    version, internal, gauss = random.getstate()
    legacy = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "python": [version, list(internal), gauss],
        "numpy": {
            "key": torch.from_numpy(legacy["state"]["key"].astype(np.int64)),
            "pos": int(legacy["state"]["pos"]),
            "has_gauss": int(legacy["has_gauss"]),
            "gauss": float(legacy["gauss"]),
        },
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's generators to a state from ``capture_rng``."""
    torch.set_rng_state(state["torch"].cpu())
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(x) for x in internal), gauss))
    numpy = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": "MT19937",
            "state": {"key": numpy["key"].cpu().numpy().astype(np.uint32), "pos": numpy["pos"]},
            "has_gauss": numpy["has_gauss"],
            "gauss": numpy["gauss"],
        }
    )
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        states = [s.cpu() for s in cuda][: torch.cuda.device_count()]
        torch.cuda.set_rng_state_all(states)


__all__ = ["capture_rng", "restore_rng"]
