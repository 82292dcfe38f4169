"""One cheap decision per optimizer step: are all gradients finite? And, when the answer is
no, the buffers (BatchNorm statistics) put back as they were before the step.

Uses torch's fused AMP kernel (``torch._amp_foreach_non_finite_check_and_unscale_``, what
GradScaler runs) with a scale of 1, over gradients grouped once by device and dtype. Run on
gradients DDP has already averaged, it gives the same answer on every rank. The answer is read
on the host (``all_finite``) or kept on the device (``found_nonfinite``: a flag that an
optimizer which skips on the device takes, as GradScaler hands it to torch's fused optimizers).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

import torch


class GradientFiniteCheck:
    """``all_finite()`` is False when any gradient of ``params`` holds a NaN or an inf.

    Costs one fused kernel per device/dtype group and one boolean read from the device. In one
    process on a CPU, where each op dispatch costs microseconds, that is most of what the
    non-finite guard adds to a step of a tiny model (about 10 µs).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter]) -> None:
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]] = defaultdict(list)
        for param in params:
            groups[(param.device, param.dtype)].append(param)
        self._groups = [
            (members, torch.zeros(1, device=device), torch.ones(1, device=device))
            for (device, _), members in groups.items()
        ]
        # Sharded parameters (FSDP2's DTensors): each rank checks its own shard, and the
        # strategy makes the ranks agree.
        self._sharded = any(callable(getattr(p, "to_local", None)) for p in self._params(groups))

    def all_finite(self, extra: Sequence[torch.Tensor] = ()) -> bool:
        """Whether every gradient, and every tensor in ``extra`` (detached floating-point
        tensors, such as the losses of the step), is finite. Tensors in ``extra`` join the
        kernel of their device's group."""
        if len(self._groups) == 1:  # the common case, one device and dtype: no sorting
            members, found_inf, one = self._groups[0]
            device = found_inf.device
            if all(t.device == device for t in extra):
                tensors = self._grads(members)
                tensors.extend(extra)
                return not tensors or self._check(tensors, found_inf, one)
        finite = True
        pending = list(extra)
        for members, found_inf, one in self._groups:
            tensors = self._grads(members)
            if pending:
                device = found_inf.device
                tensors += [t for t in pending if t.device == device]
                pending = [t for t in pending if t.device != device]
            if tensors and not self._check(tensors, found_inf, one):
                finite = False
        return finite and all(bool(torch.isfinite(t).all()) for t in pending)

    def found_nonfinite(self, extra: Sequence[torch.Tensor] = ()) -> torch.Tensor:
        """``all_finite``'s answer left on the device, with no host read: a new float32 tensor
        of shape (), 1.0 when some gradient (or a tensor of ``extra``) is NaN/inf, else 0.0,
        on the first group's device. A zero fill and the fused check per device/dtype group
        (``extra`` joins the kernel of its device's group), plus an op per other device."""
        if len(self._groups) == 1:  # the common case, one device and dtype: no sorting
            members, _, one = self._groups[0]
            device = one.device
            if all(t.device == device for t in extra):
                found = torch.zeros((), device=device)
                tensors = self._grads(members)
                tensors.extend(extra)
                if tensors:
                    torch._amp_foreach_non_finite_check_and_unscale_(tensors, found, one)
                return found
        flags: dict[torch.device, torch.Tensor] = {}
        pending = list(extra)
        for members, _, one in self._groups:
            device = one.device
            flag = flags.get(device)
            if flag is None:  # the kernel only ever sets the flag: a device's groups share it
                flag = flags[device] = torch.zeros((), device=device)
            tensors = self._grads(members)
            if pending:
                tensors += [t for t in pending if t.device == device]
                pending = [t for t in pending if t.device != device]
            if tensors:
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, one)
        if not flags:
            device = pending[0].device if pending else torch.device("cpu")
            flags[device] = torch.zeros((), device=device)
        main = next(iter(flags.values()))
        others = [flag for flag in flags.values() if flag is not main]
        for flag in others:
            main.add_(flag.to(main.device, non_blocking=True))
        for tensor in pending:  # on a device without gradients
            main.add_(torch.isfinite(tensor).all().logical_not().to(main.device))
        return main.clamp_(max=1.0) if others or pending else main

    @staticmethod
    def _params(
        groups: dict[tuple[torch.device, torch.dtype], list[torch.nn.Parameter]],
    ) -> Iterable[torch.nn.Parameter]:
        return (p for members in groups.values() for p in members)

    def _grads(self, members: list[torch.nn.Parameter]) -> list[torch.Tensor]:
        grads = [p.grad for p in members if p.grad is not None]
        if self._sharded:
            return [_local(g) for g in grads]
        return grads

    @staticmethod
    def _check(tensors: list[torch.Tensor], found_inf: torch.Tensor, one: torch.Tensor) -> bool:
        # found_inf stays zero between calls (reset only after a hit): one op less per step.
        torch._amp_foreach_non_finite_check_and_unscale_(tensors, found_inf, one)
        if bool(found_inf):
            found_inf.zero_()
            return False
        return True


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (the tensor itself otherwise)."""
    to_local = getattr(tensor, "to_local", None)
    return to_local() if callable(to_local) else tensor


_ByteGroups = list[tuple[list[torch.Tensor], list[torch.Tensor]]]
_Pairs = list[tuple[torch.Tensor, torch.Tensor]]


class BufferSnapshot:
    """The module's buffers as they were at the start of an optimizer step, so a skipped step
    can leave them untouched (a NaN batch would otherwise poison BatchNorm's running
    statistics, on every rank with SyncBatchNorm).

    ``take`` copies them (one fused copy per step, only for modules with buffers);
    ``restore`` copies them back; ``restore_where`` does it on the device where a flag is set.
    All are no-ops for a module without buffers. ``fused``: ``restore_where`` selects the
    bytes of all the buffers in four fused kernels (the default on CUDA, where each kernel is a
    launch), else with a ``torch.where`` per buffer (faster on a CPU, whose foreach kernels
    loop over the tensors anyway).
    """

    def __init__(self, module: torch.nn.Module, fused: bool | None = None) -> None:
        self._buffers = [b for b in module.buffers() if b.numel()]
        self._saved = [torch.empty_like(b) for b in self._buffers]
        self._pairs: _Pairs = list(zip(self._buffers, self._saved, strict=True))
        if fused is None:
            fused = any(b.device.type == "cuda" for b in self._buffers)
        self.fused = fused
        self._as_bytes: tuple[_ByteGroups, _Pairs] | None = None
        self.taken = False

    @property
    def has_buffers(self) -> bool:
        return bool(self._buffers)

    def take(self) -> None:
        if self._buffers:
            torch._foreach_copy_(self._saved, self._buffers)
        self.taken = True

    def restore(self) -> None:
        if self._buffers and self.taken:
            torch._foreach_copy_(self._buffers, self._saved)
        self.taken = False

    def restore_where(self, skipped: torch.Tensor) -> None:
        """``restore`` decided on the device: the buffers become their snapshot where
        ``skipped`` (a 0-dim tensor, 1 or 0) is set, and stay otherwise, with no host read.
        Fused, the bytes are selected as unsigned integers (each buffer's bytes plus
        ``skipped`` times the snapshot's bytes minus them, modulo 256: exact for any value,
        NaN included), four kernels for all the buffers of a device whatever their number and
        dtypes (torch's fused path wants one dtype, the factor's included)."""
        if not (self._buffers and self.taken):
            self.taken = False
            return
        groups, scattered = self._bytes() if self.fused else ([], self._pairs)
        for buffers, saved in groups:
            skip = skipped.to(buffers[0].device, torch.uint8)
            differences = torch._foreach_sub(saved, buffers)
            torch._foreach_mul_(differences, skip)
            torch._foreach_add_(buffers, differences)
        if scattered:
            flag = skipped.bool()
            for buffer, saved_buffer in scattered:
                if buffer.device != flag.device:
                    flag = flag.to(buffer.device)
                torch.where(flag, saved_buffer, buffer, out=buffer)
        self.taken = False

    def _bytes(self) -> tuple[_ByteGroups, _Pairs]:
        """The contiguous buffers and their snapshot as uint8 views, grouped by device, and the
        others (built once)."""
        if self._as_bytes is None:
            groups: dict[torch.device, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
            scattered: _Pairs = []
            for buffer, saved in self._pairs:
                if not (buffer.is_contiguous() and saved.is_contiguous()):
                    scattered.append((buffer, saved))
                    continue
                buffers, snapshot = groups.setdefault(buffer.device, ([], []))
                buffers.append(buffer.reshape(-1).view(torch.uint8))
                snapshot.append(saved.reshape(-1).view(torch.uint8))
            self._as_bytes = (list(groups.values()), scattered)
        return self._as_bytes


__all__ = ["BufferSnapshot", "GradientFiniteCheck"]
