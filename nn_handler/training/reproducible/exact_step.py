"""ExactStep: one optimizer step of the reproducible mode, the same bits at any world size.

For each micro-batch this rank owns (data/fixed_batches.py), in order: the random streams are
seeded from (seed, optimizer step, micro-batch index), never from the rank; forward and
backward run alone (fresh gradients); the gradients go, in fixed point at the scales kept
from the last step (``fixed_point.Scale``), into one int64 accumulator, and each tensor's
largest magnitude (times the micro-batch's samples) is kept. Then one int64 sum, on every
rank whatever it owns, carries the accumulator and, in slots only the owner fills, each
micro-batch's samples, loss, BatchNorm statistics and maxima. A run's first step agrees on
the maxima first (a max all_reduce) to set the scales, and a step whose agreed maxima no
longer fit them sets new ones (every rank decides it from the same agreed values): both pass
over their micro-batches again (the same seeds, data and parameters: the same gradients) and
sum again. Every rank then holds the same gradient (the sample-weighted
mean over the global batch), loss and statistics, and the optimizer steps as usual
(Optimization.step). Other buffers must not change in a training forward: the first step
checks it. A step reads the device to the host once (after the sum: samples, losses and the
scales' verdict), so a GPU's queue stays full; the first step and a rescaled one read more
(the agreed maxima, and the new scales' exponents: one float per tensor on the host).
In a fault-tolerant run, a rank's contribution to a sum that failed is kept (``unsent``), and
the step's redo adds it (``carried``) instead of computing its micro-batches again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from nn_handler.checkpoint.registry import describe_tensor
from nn_handler.config.training import ReproducibleConfig
from nn_handler.data.fixed_batches import StepBatch
from nn_handler.distributed.communicator import Communicator
from nn_handler.errors import CheckpointError, ConfigError
from nn_handler.strategies.exact_gradients import ExactGradients, ReplicatedGradients
from nn_handler.training.reproducible import fixed_point
from nn_handler.training.reproducible.carried import Carried
from nn_handler.training.reproducible.norm_statistics import NormStatistics
from nn_handler.training.reproducible.workspace import Workspace


def micro_seed(seed: int, step: int, index: int) -> int:
    """The seed of micro-batch ``index`` of optimizer step ``step`` (63 bits, well mixed)."""
    state = np.random.SeedSequence([seed, step, index, 0x5EED]).generate_state(1, np.uint64)
    return int(state[0]) & (2**63 - 1)


def check_sharded_micro_batches(micro_batches: int, world: int) -> None:
    """ConfigError when a sharded model's step has fewer micro-batches than ranks: every rank
    must run a forward and backward of its own (the parameters are gathered in each)."""
    if micro_batches < world:
        raise ConfigError(
            f"reproducible with sharded parameters: a step has {micro_batches} micro-batches "
            f"(global_batch_size / micro_batch_size) for {world} ranks, and every rank must "
            f"run a forward and backward of its own (the parameters are gathered in each); "
            f"make global_batch_size at least {world} x micro_batch_size."
        )


class ExactStep:
    """The reproducible mode's step for ``module`` (the plain module the optimizer trains).

    Attributes:
        bytes_per_step: what a step's int64 sum sends per rank (gradients and slots).
        collectives: the collectives made: one per step, two on a run's first step and on a
            step whose gradients outgrew their scale (``rescaled_steps``).
    """

    #: Whether a rank's part of a failed sum can be added to the step's redo (``carried``):
    #: an integer sum's order does not change its bits.
    carries_sums = True

    def __init__(
        self, config: ReproducibleConfig, module: nn.Module, comm: Communicator,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.config = config
        self.comm = comm
        self.device = device
        self.module = module
        self.norms = NormStatistics(module)
        self.params: list[nn.Parameter] = []
        self.gradients: ExactGradients = ReplicatedGradients([])
        self.bytes_per_step = 0
        #: Collectives made (one per step, two on the first and on a rescale) and rescales.
        self.collectives = 0
        self.rescaled_steps = 0
        self.scale = fixed_point.Scale(config.micro_batches, device)
        self._checked = False
        self._numels = torch.zeros(0, dtype=torch.int64)
        self._dtype = torch.float32
        # A row (one per micro-batch): its samples and each BatchNorm layer's elements per
        # channel (the host knows them: copied in once per step), its loss, the BatchNorm
        # statistics (norms.after_micro), the per-tensor maxima.
        self._loss = 1 + len(self.norms.layers)
        self._stats = self._loss + 1
        self._maxima = self._stats + self.norms.width  # where a row's per-tensor maxima start
        self._work = Workspace(device)
        self._template: Any = None  # a micro-batch seen, for filler passes (``_fill``)
        self._width = self._maxima
        #: Fault tolerance: keep this rank's contribution before each sum (``unsent``: what
        #: a failed sum leaves it), and add ``carried`` (set before a redo) to the next one.
        self.keeps_unsent = False
        self.unsent: Carried | None = None
        self.carried: Carried | None = None

    def adopt(self, params: list[nn.Parameter], gradients: ExactGradients | None = None) -> None:
        """The parameters that train (after ``configure_optimizers``) and where their
        gradients are read and summed (the strategy's; default: replicated)."""
        self.params = params
        self.gradients = gradients if gradients is not None else ReplicatedGradients(params)
        self._numels = torch.tensor([p.numel() for p in params], dtype=torch.int64)
        self._width = self._maxima + len(params)
        if self.gradients.balanced:
            check_sharded_micro_batches(self.config.micro_batches, self.comm.world_size)
        dtypes = {p.dtype for p in params}
        if any(not d.is_floating_point for d in dtypes):
            raise ConfigError("the reproducible mode trains floating-point parameters only.")
        self._dtype = torch.float64 if torch.float64 in dtypes else torch.float32

    def run(
        self, step: StepBatch, forward_backward: Callable[[Any], torch.Tensor], global_step: int
    ) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of ``step``, then the exact
        reduction: every parameter's ``.grad`` is the step's gradient, the same on every
        rank. Returns the step's loss (float64, sample-weighted over the global batch).
        Every rank must call this for every step, with or without micro-batches."""
        rows = torch.zeros(
            (self.config.micro_batches, self._width), dtype=torch.float64, device=self.device
        )
        buffer = self._buffer(int(self._numels.sum()) + rows.numel())
        others = None if self._checked else _other_buffers(self.module, self.norms)
        known = torch.zeros((self.config.micro_batches, self._loss), dtype=torch.float64)
        passes = StepPasses(step, forward_backward, global_step)
        carried, self.carried, self.unsent = self.carried, None, None
        self.norms.begin_step()
        try:
            self._pass(passes, buffer, rows, known, accumulate=self._accumulating())
            rows[:, : self._loss].copy_(_pinned(known, self.device), non_blocking=True)
            if carried is not None and carried.fits(global_step, self.scale.exponents):
                passes = self._add(carried, passes, buffer, rows)
        except BaseException:
            self.norms.abort()
            raise
        if others is not None:
            _check_unchanged(self.module, others)
            self._checked = True
        try:
            return self._reduce(passes, buffer, rows)
        except BaseException:  # a lost member (fault tolerance): the statistics as they were
            if self.norms.in_step:
                self.norms.abort()
            raise

    def _add(
        self, carried: Carried, passes: StepPasses, buffer: torch.Tensor, rows: torch.Tensor
    ) -> StepPasses:
        """``carried`` (this rank's part of an abandoned attempt of the step) into this
        attempt's sum: its gradients added to the accumulator (int64: the same bits as
        computing them again), its micro-batches' rows put in. The passes returned cover its
        micro-batches too (a rescaled step passes over every micro-batch again)."""
        size = int(self._numels.sum())
        buffer[:size].add_(carried.vector[:size])
        kept = torch.tensor(carried.indices(), dtype=torch.int64, device=self.device)
        rows[kept] = fixed_point.from_slots(carried.vector[size:]).reshape(rows.shape)[kept]
        micro = tuple(sorted((*carried.micro, *passes.step.micro), key=lambda m: m.index))
        return dataclasses.replace(passes, step=dataclasses.replace(passes.step, micro=micro))

    def _buffer(self, size: int) -> torch.Tensor:
        """The step's int64 sum: the gradients' accumulator, then the slots."""
        return self._work.get("sum", (size,), torch.int64)

    def _accumulating(self) -> bool:
        """Whether the first pass accumulates the gradients (a kept scale: yes; a run's
        first step agrees on the maxima first, then passes again)."""
        return self.scale.exponents is not None

    def _pass(
        self,
        passes: StepPasses,
        buffer: torch.Tensor,
        rows: torch.Tensor | None = None,
        known: torch.Tensor | None = None,
        accumulate: bool = True,
    ) -> None:
        """Forward and backward of this rank's micro-batches (and filler passes): each
        micro-batch's gradient accumulated into ``buffer`` as soon as its backward ends (one
        accumulator, no copy per micro-batch); the first pass of a step also fills its
        ``rows`` (maxima, loss, statistics) and ``known`` (samples, counts). A pass again
        (``rows`` None: a run's first step, or a rescaled one) computes the same gradients:
        the same seeds, data and parameters, deterministic kernels."""
        step = passes.step
        size = int(self._numels.sum())
        accumulator = buffer[:size]
        if accumulate and not step.micro:
            accumulator.zero_()
        for i, micro in enumerate(step.micro):
            self.gradients.clear()
            seed = micro_seed(self.config.seed, passes.global_step, micro.index)
            inputs = micro.batch  # loaded here when the loader loads on demand
            with _seeded(self.device, seed):
                loss = passes.forward_backward(inputs)
            parts = self.gradients.gradients()
            stats, counts = self.norms.after_micro()
            if rows is not None and known is not None:
                row = rows[micro.index]
                if parts:
                    self._keep_maxima(row, parts, micro.size)
                row[self._loss].copy_(loss.detach().reshape(()))
                if len(stats):
                    row[self._stats : self._maxima].copy_(stats)
                known[micro.index] = torch.tensor([micro.size, *counts], dtype=torch.float64)
            if accumulate:
                self._accumulate(parts, micro.size, accumulator, first=i == 0)
            del parts  # else they live through the next backward: the gradients twice
        self._fill(step, passes.forward_backward, passes.global_step)

    def _accumulate(
        self, parts: list[torch.Tensor], samples: int, accumulator: torch.Tensor, first: bool
    ) -> None:
        """One micro-batch's gradient (``parts``: each parameter's) in fixed point, into the
        int64 ``accumulator``, read from the gradients themselves (no flat copy). Not
        checked here (a host sync): a value that does not fit the scale, or is not finite,
        makes meaningless integers, and the agreed maxima, which bound this rank's, then say
        so on every rank, which passes again at new scales or skips the step."""
        if self.scale.exponents is None:  # no agreed scale (a non-finite first step)
            accumulator.zero_()
            return
        work = self._work.get("float64", accumulator.shape, torch.float64)
        scaled = fixed_point.scaled(parts, self.scale.multipliers(samples), work)  # exact
        if first:
            accumulator.copy_(scaled)
        else:  # through int64 chunks: a whole copy would cost the accumulator's size again
            fixed_point.add_as_int64(accumulator, scaled)

    def _fill(
        self, step: StepBatch, forward_backward: Callable[[Any], torch.Tensor], global_step: int
    ) -> None:
        """With sharded parameters every rank must run as many forwards and backwards as
        the rank with the most micro-batches (each gathers the parameters with the others):
        a rank with fewer runs filler passes over a micro-batch it has seen (its random
        streams seeded apart), and drops their gradients and statistics."""
        if not self.gradients.balanced:
            return
        if step.micro:  # kept from step to step: held_bytes counts it
            self._template = step.micro[-1].batch
        size, world = self.config.micro_batch_size, self.comm.world_size
        fillers = math.ceil(math.ceil(step.samples / size) / world) - len(step.micro)
        if fillers > 0 and self._template is None:
            raise ConfigError(
                f"reproducible with sharded parameters: rank {self.comm.rank} owns no "
                f"micro-batch of step {global_step} and has seen none to run the forward and "
                f"backward the other ranks gather parameters for; use a world size of at "
                f"most {self.config.micro_batches} (the micro-batches of a step)."
            )
        for k in range(fillers):
            self.gradients.clear()
            index = self.config.micro_batches + k  # beyond the step's own micro-batches
            with _seeded(self.device, micro_seed(self.config.seed, global_step, index)):
                forward_backward(self._template)
            self.norms.after_micro()  # the filler's statistics: not the step's
        self.gradients.clear()

    def _keep_maxima(self, row: torch.Tensor, parts: list[torch.Tensor], samples: int) -> None:
        """Each gradient tensor's largest magnitude (times the micro-batch's samples) into
        its slots: the scales are set from them."""
        row[self._maxima :] = fixed_point.largest_magnitudes(parts).mul_(samples)

    def _reduce(self, passes: StepPasses, buffer: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """One int64 sum (two on a run's first step, and when a gradient outgrew its scale),
        then the gradients, statistics and loss from it, the same on every rank."""
        step = passes.step
        size = buffer.numel() - rows.numel()
        if self.scale.exponents is None:  # the first step: agree on the maxima, pass again
            local = rows[:, self._maxima :].amax(0) if len(step.micro) else rows.new_zeros(0)
            agreed = self._agreed_maxima(local)
            if agreed is not None:
                self.scale.recenter(agreed)
            self._pass(passes, buffer)
        buffer[size:] = fixed_point.as_slots(rows).reshape(-1)
        if self.keeps_unsent and (exponents := self.scale.exponents) is not None:
            # Copied: a sum may fail half-way through the buffer. Kept in the workspace (the
            # memory plan counts it); a redo reads it (``_add``) before its own copy.
            vector = self._work.get("unsent", buffer.shape, torch.int64).copy_(buffer)
            self.unsent = Carried(passes.global_step, exponents.clone(), vector, step.micro)
        summed = self.gradients.sum_(buffer, rows.numel(), self.comm)
        self.collectives += self.gradients.collectives_per_sum
        rows = fixed_point.from_slots(summed[-rows.numel() :]).reshape(rows.shape)
        maxima = rows[:, self._maxima :].amax(0)  # absent micro-batches' rows are zeros
        flags = self.scale.flags(maxima)
        # The step's one host read: samples, counts and losses, and the scales' verdict.
        read = torch.cat([rows[:, : self._stats].reshape(-1), flags]).tolist()
        width = self._stats
        head = [read[j * width : (j + 1) * width] for j in range(rows.shape[0])]
        finite, _, holds = fixed_point.Scale.verdict_of(read[-len(flags) :])
        count = sum(int(row[0]) for row in head)
        total = summed[: sum(self.gradients.local_numels)]
        gradient = self._work.get("gradient", total.shape, self._dtype)
        if not finite:  # NaN/inf somewhere: the step skips
            gradient.fill_(math.nan)
        else:
            if not holds:  # a gradient outgrew its scale: pass again, sum again
                self.scale.recenter(maxima)
                self.rescaled_steps += 1
                self._pass(passes, buffer)
                total = self.gradients.sum_(buffer[:size], 0, self.comm)
                self.collectives += self.gradients.collectives_per_sum
            work = self._work.get("float64", total.shape, torch.float64)
            sizes, factors = self.gradients.local_numels, self.scale.factors(count)
            fixed_point.dequantize(total, sizes, factors, out=gradient, work=work)
        self.bytes_per_step = buffer.numel() * 8
        return self._apply(gradient, rows, head)

    def _apply(
        self, gradient: torch.Tensor, rows: torch.Tensor, head: list[list[float]]
    ) -> torch.Tensor:
        """The step's reduced ``gradient`` (flat) into every parameter's ``.grad``, its
        reduced ``rows`` into the BatchNorm statistics; returns the step's loss (from
        ``head``: the rows' first columns, read to the host)."""
        flat = gradient  # replicated: the gradients are views of it until the next step
        if gradient.dtype != self._dtype:
            flat = self._work.get("gradient", gradient.shape, self._dtype).copy_(gradient)
        self.gradients.assign(flat)
        self.norms.end_step(rows[:, self._stats : self._maxima], rows[:, 1 : self._loss])
        samples = [int(row[0]) for row in head]
        loss = math.fsum(n * row[self._loss] for n, row in zip(samples, head, strict=True) if n)
        value = torch.tensor(loss / max(sum(samples), 1), dtype=torch.float64)
        return _pinned(value, self.device).to(self.device, non_blocking=True)

    def _agreed_maxima(self, local: torch.Tensor) -> torch.Tensor | None:
        """Every rank's largest magnitude per tensor (None: some are not finite)."""
        if not len(local):
            local = torch.zeros(len(self.params), dtype=torch.float64, device=self.device)
        finite = bool(torch.isfinite(local).all())
        head = torch.cat([torch.where(torch.isfinite(local), local, 0.0),
                          local.new_tensor([0.0 if finite else 1.0])])  # fmt: skip
        self.comm.all_reduce_(head, "max")
        self.collectives += 1
        return None if bool(head[-1] > 0) else head[:-1]

    def held_bytes(self) -> int:
        """What the exact sum needs in a step beyond the parameters' gradients (the memory
        plan's "reproducible mode" item: strategies/memory_plan.py): its buffers kept from step
        to step, what the gradients' side makes in a step and, sharded, the micro-batch kept
        for filler passes (a micro-batch's input: in no item of the plan)."""
        kept = [t for name, t in self._work.kept.items() if name != "gradient"]
        kept += [t for t in tree_flatten(self._template)[0] if isinstance(t, torch.Tensor)]
        return sum(t.numel() * t.element_size() for t in kept) + self.gradients.held_bytes()

    def state_dict(self) -> dict[str, Any]:
        """The fixed-point scales (the next step's depend on them: a resume keeps them)."""
        return {"exponents": self.scale.exponents}

    def load_state_dict(self, state: Any, source: str = "the checkpoint") -> None:
        """The saved scales: an int64 exponent per trained parameter tensor, else a
        CheckpointError (other values would silently leave the bit-identical path)."""
        exponents = (state or {}).get("exponents")
        count = len(self.params)
        if exponents is not None and not (
            isinstance(exponents, torch.Tensor)
            and exponents.dtype == torch.int64
            and tuple(exponents.shape) == (count,)
        ):
            found = (
                describe_tensor(exponents)
                if isinstance(exponents, torch.Tensor)
                else type(exponents).__name__
            )
            raise CheckpointError(
                f"the 'reproducible' state of {source}: its fixed-point exponents are {found}, "
                f"this run needs int64 of shape ({count},) (one per trained parameter tensor); "
                f"the checkpoint was not written by this model in the reproducible mode."
            )
        self.scale.set(None if exponents is None else exponents.to(self.device))


@dataclasses.dataclass(frozen=True)
class StepPasses:
    """What a pass over a step's micro-batches runs again: the step, the forward and
    backward, the optimizer step's index (the micro-batches' seeds)."""

    step: StepBatch
    forward_backward: Callable[[Any], torch.Tensor]
    global_step: int


def _pinned(values: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``values`` (on the host) in pinned memory when ``device`` is a GPU: copied with
    ``non_blocking=True``, they make no host sync (a pageable copy waits for the stream)."""
    return values.pin_memory() if device.type == "cuda" else values


@contextlib.contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """The random streams a micro-batch draws from (the CPU's, and its GPU's on a CUDA
    device) forked and seeded with ``seed`` (the streams outside are left as they were).

    The forked streams are the ones seeded: ``torch.manual_seed`` would also seed every other
    device's, which the fork does not restore, and, where CUDA, XPU or MTIA is not
    initialised, queue each seeding with a formatted stack trace (a stat per frame: about
    1 ms a micro-batch on a CPU)."""
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type=device.type):
        torch.default_generator.manual_seed(seed)
        if cuda:
            with torch.cuda.device(device):
                torch.cuda.manual_seed(seed)
        elif device.type != "cpu":  # another accelerator: every stream, as before
            torch.manual_seed(seed)
        yield


def _other_buffers(module: nn.Module, norms: NormStatistics) -> dict[str, torch.Tensor]:
    """Every buffer but the BatchNorm statistics the mode combines itself, copied."""
    managed = {id(layer) for _, layer in norms.layers}
    found: dict[str, torch.Tensor] = {}
    for name, owner in module.named_modules():
        if id(owner) in managed:
            continue
        for key, buffer in owner.named_buffers(recurse=False):
            if buffer is not None:
                found[f"{name}.{key}" if name else key] = buffer.detach().clone()
    return found


def _check_unchanged(module: nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = dict(module.named_buffers())
    for name, saved in before.items():
        current = now.get(name)
        if current is not None and not torch.equal(current, saved):
            raise ConfigError(
                f"the buffer {name!r} changed in a training forward; the reproducible mode "
                f"keeps only BatchNorm running statistics identical across world sizes. Make "
                f"it a constant (or compute it outside the forward), or train without "
                f"TrainerConfig.reproducible."
            )


__all__ = ["ExactStep", "check_sharded_micro_batches", "micro_seed"]
