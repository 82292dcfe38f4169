"""One cheap decision per optimizer step: are all gradients finite?

Uses torch's fused AMP kernel (``torch._amp_foreach_non_finite_check_and_unscale_``, what
GradScaler runs) with a scale of 1, over gradients grouped once by device and dtype. Run on
gradients DDP has already averaged, it gives the same answer on every rank.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable

import torch


class GradientFiniteCheck:
    """``all_finite()`` is False when any gradient of ``params`` holds a NaN or an inf.

    Costs one fused kernel per device/dtype group and one boolean read from the device.
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = defaultdict(list)
        for param in params:
            groups[(param.device, param.dtype)].append(param)
        self._groups = [
            (members, torch.zeros(1, device=device), torch.ones(1, device=device))
            for (device, _), members in groups.items()
        ]

    def all_finite(self) -> bool:
        finite = True
        for members, found_inf, one in self._groups:
            grads = [p.grad for p in members if p.grad is not None]
            if not grads:
                continue
            found_inf.zero_()
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found_inf, one)
            finite = finite and not bool(found_inf)
        return finite


__all__ = ["GradientFiniteCheck"]
