"""Models built on the meta device: materialised on each rank as its own shards only.

``materialize`` gives every tensor storage on the device (``to_empty``) and initialises it
module by module, children before parents, as a constructor does: each module's direct
parameters and buffers are built whole on the device, one module at a time (the largest
module, never the whole model), initialised by the module's ``reset_parameters`` under a
seed drawn from (``seed``, the module's name), and this rank's piece is copied into its
shard. The weights are therefore the same under every strategy, world size and mesh.

``load_weights_file`` fills the model from a state dict file instead (torch.save's, or a
checkpoint file's ``model``), memory-mapped: each rank reads only its pieces."""

from __future__ import annotations

import contextlib
import hashlib
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch import nn

from nn_handler.checkpoint.io import load_file
from nn_handler.checkpoint.model_state import strip_wrapper_prefixes
from nn_handler.errors import CheckpointError, ConfigError

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor


def on_meta(module: nn.Module) -> bool:
    """Whether ``module`` was built on the meta device (every parameter and buffer on it);
    ConfigError when only some are, naming one of each."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    meta = [name for name, t in tensors if t.is_meta]
    if meta and len(meta) != len(tensors):
        real = next(name for name, t in tensors if not t.is_meta)
        raise ConfigError(
            f"the model is partly on the meta device ({meta[0]!r} is, {real!r} is not): build "
            f"all of it under `with torch.device('meta'):`, or none of it."
        )
    return bool(meta)


def _seed_of(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


def _initializer(module: nn.Module) -> Any:
    for method in ("reset_parameters", "_reset_parameters"):
        found = getattr(module, method, None)
        if callable(found):
            return found
    return None


def _own(module: nn.Module) -> dict[str, torch.Tensor]:
    """The parameters and buffers ``module`` holds itself (not its children's), by name."""
    return {
        **dict(module.named_parameters(recurse=False)),
        **dict(module.named_buffers(recurse=False)),
    }


def materialize(module: nn.Module, device: torch.device, seed: int) -> None:
    """Allocate ``module``'s tensors (its shards, where a strategy sharded it) on ``device``
    and initialise them from each module's ``reset_parameters`` (see the module docstring).
    ConfigError naming the module when one holds tensors and has no ``reset_parameters``."""
    module.to_empty(device=device)
    for name, sub in reversed(list(module.named_modules())):
        own = _own(sub)
        if not own:
            continue
        reset = _initializer(sub)
        if reset is None:
            where = name or "the root module"
            raise ConfigError(
                f"module {where!r} ({type(sub).__name__}) of the meta-device model holds "
                f"{sorted(own)} and has no reset_parameters() to initialise them: give it one, "
                f"or load the weights from a file (trainer.init_weights)."
            )
        whole = _initialised_whole(sub, own, reset, device, _seed_of(seed, name), name)
        for key, tensor in own.items():
            with torch.no_grad():
                _copy_piece(tensor, whole[key], f"{name}.{key}" if name else key)


def _integer_sentinel(dtype: torch.dtype) -> int:
    """The lowest signed value, the highest unsigned one (0 is too common an initial value)."""
    info = torch.iinfo(dtype)
    return int(info.min) if info.min < 0 else int(info.max)


def _fill_sentinel(tensor: torch.Tensor) -> None:
    """NaN for floating-point tensors, an extreme value for integers (booleans: none)."""
    if tensor.is_floating_point() or tensor.is_complex():
        tensor.fill_(float("nan"))
    elif tensor.dtype != torch.bool:
        tensor.fill_(_integer_sentinel(tensor.dtype))


def _holds_sentinel(tensor: torch.Tensor) -> bool:
    """Whether some element of ``tensor`` is still the sentinel (an initialiser that skipped
    it, or wrote only part of it)."""
    if tensor.numel() == 0 or tensor.dtype == torch.bool:
        return False
    if tensor.is_floating_point() or tensor.is_complex():
        return bool(torch.isnan(tensor).any())
    return bool((tensor == _integer_sentinel(tensor.dtype)).any())


def _initialised_whole(
    sub: nn.Module,
    own: dict[str, torch.Tensor],
    reset: Any,
    device: torch.device,
    seed: int,
    name: str = "",
) -> dict[str, torch.Tensor]:
    """``sub``'s own tensors built whole on ``device``, initialised by ``reset`` (the module's
    tensors swapped for the whole ones during the call, and back after)."""
    parameters = dict(sub.named_parameters(recurse=False))
    try:
        for key, tensor in own.items():
            whole = torch.empty(tuple(tensor.shape), dtype=tensor.dtype, device=device)
            _fill_sentinel(whole)  # what reset() leaves unwritten is found after it
            swapped = nn.Parameter(whole, tensor.requires_grad) if key in parameters else whole
            setattr(sub, key, swapped)
        with _seeded(device, seed), torch.no_grad():
            reset()
        result: dict[str, torch.Tensor] = {}
        for key in own:
            value = getattr(sub, key)
            if not isinstance(value, torch.Tensor):
                raise ConfigError(
                    f"{type(sub).__name__}.reset_parameters() left {key!r} as {value!r}, not a "
                    f"tensor; it must initialise its tensors in place."
                )
            if _holds_sentinel(value):
                raise ConfigError(
                    f"{type(sub).__name__}.reset_parameters() left {key!r} (of the meta-device "
                    f"model's module {name or 'at the root'!r}) uninitialised: training would "
                    f"start from whatever memory held. Initialise every parameter and buffer "
                    f"in it, or load the weights from a file (trainer.init_weights)."
                )
            result[key] = value.detach()
        return result
    finally:
        for key, tensor in own.items():
            setattr(sub, key, tensor)


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Torch's generators (the CPU's and ``device``'s) seeded for one call, restored after."""
    devices = [device.index or 0] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield


def _is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing torch.distributed.tensor (and sympy,
    which it imports: 0.4 s of every process's start) when nothing has made one."""
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_piece(full: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """The part of the whole tensor ``full`` that ``target`` holds on this rank: ``full``
    itself for a plain tensor; for a DTensor, its chunk along each sharded mesh dimension
    (torch.chunk's split, as DTensor's ``Shard``), a view (nothing copied)."""
    if not _is_dtensor(target):
        return full
    from torch.distributed.tensor import DTensor, Shard

    target = cast(DTensor, target)
    piece = full
    coordinate = list(target.device_mesh.get_coordinate() or ())
    for mesh_dim, placement in enumerate(target.placements):
        if isinstance(placement, Shard):
            count = target.device_mesh.size(mesh_dim)
            chunks = torch.chunk(piece, count, dim=placement.dim)
            index = coordinate[mesh_dim]
            piece = chunks[index] if index < len(chunks) else piece.narrow(placement.dim, 0, 0)
    return piece


def _copy_piece(target: torch.Tensor, full: torch.Tensor, key: str) -> None:
    if tuple(full.shape) != tuple(target.shape):
        raise CheckpointError(
            f"weight {key!r} has shape {tuple(full.shape)}, the model's is {tuple(target.shape)}."
        )
    local = cast("DTensor", target).to_local() if _is_dtensor(target) else target
    local.copy_(local_piece(full, target))


def _model_tensors(module: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors a state dict of ``module`` holds (persistent buffers only), by name."""
    keys = set(module.state_dict(keep_vars=True))
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        if name in keys:
            yield name, tensor


def transient_buffers(module: nn.Module) -> list[str]:
    """The buffers no state dict holds (``persistent=False``, such as a rotary table): a file
    cannot give them, so a meta-device model that has them is initialised before loading."""
    kept = set(module.state_dict(keep_vars=True))
    return [name for name, _ in module.named_buffers() if name not in kept]


def load_weights_file(module: nn.Module, path: str | Path) -> None:
    """Fill ``module`` (plain or sharded) from the state dict file at ``path``: torch.save's
    dict of tensors, or a checkpoint file (its ``model``), read ``weights_only`` and
    memory-mapped so that each rank touches only its pieces. CheckpointError naming the
    missing, unexpected or mis-shaped keys."""
    loaded = load_file(path, mmap=True)
    state: Any = loaded.get("model", loaded) if isinstance(loaded, Mapping) else loaded
    if not isinstance(state, Mapping) or not all(
        isinstance(v, torch.Tensor) for v in state.values()
    ):
        raise CheckpointError(
            f"{path} holds no state dict (a mapping of names to tensors, or a checkpoint whose "
            f"'model' is one); trainer.init_weights needs one."
        )
    targets = dict(_model_tensors(module))
    weights = strip_wrapper_prefixes(state, targets)
    missing = sorted(set(targets) - set(weights))
    unexpected = sorted(set(weights) - set(targets))
    if missing or unexpected:
        raise CheckpointError(
            f"the weights in {path} do not match {type(module).__name__}: missing "
            f"{missing[:10]}, unexpected {unexpected[:10]}. Build the model the same way as "
            f"the one that wrote them."
        )
    with torch.no_grad():
        for key, target in targets.items():
            _copy_piece(target, weights[key], key)


__all__ = ["load_weights_file", "local_piece", "materialize", "on_meta", "transient_buffers"]
