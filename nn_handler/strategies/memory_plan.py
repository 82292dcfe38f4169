"""The memory plan: what one rank holds for a layout (strategy, shards, activation
checkpointing), item by item, computed from the model's shapes before anything is allocated,
and checked against a budget with a layout that would fit when it does not.

The items (bytes per rank): the parameters (and buffers), the gradients, the optimizer state,
the optimizer step's workspace, the communication buffers (FSDP2: the gathered parameters and
unsharded gradients of the blocks in flight; DDP: its gradient buckets) and the activations
kept for backward (estimated by running the model on the meta device:
activation_estimate.py). The total is their sum, the gradients and the activations counted as
the larger of the two (measured on CPU ranks within 15%: benchmarks/memory_plan.py); the
total is the larger of that training peak and the validation peak (the evaluation pass, with
the gradients still held)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
from torch import nn

from nn_handler.errors import ConfigError

#: The plan's item for the evaluation pass, and how it is counted.
VALIDATION = "validation"
EVALUATION_NOTE = (
    "the evaluation pass of one batch, bounded by full checkpointing's activations (its "
    "forward keeps none for backward), the gradients still held"
)
#: The reproducible mode's item for a micro-batch's own gradients (replicated), and its note.
MICRO_GRADIENTS = "micro-batch gradients"
MICRO_GRADIENTS_NOTE = (
    "a micro-batch's own gradients while the step's flat gradient is kept for the optimizer"
)
#: What a member of a fault-tolerant run keeps (its item in the plan).
FAULT_TOLERANCE_NOTE = (
    "an int64 copy of each step's sum, kept for a redo without a lost member (twice that "
    "during a redo)"
)
#: The plan's item for a member's state in flight when a member joins (transport.py).
JOIN = "a member's join"
JOIN_NOTE = (
    "this rank's state (parameters, buffers, optimizer state) twice while it is sent to a "
    "member that joins, or received: its bytes, and the tensors made of them"
)
#: How many blocks FSDP2 holds gathered at once (the one computing and the one prefetched),
#: for their parameters in forward and again for their unsharded gradients in backward.
BLOCKS_IN_FLIGHT = 2


@dataclass(frozen=True)
class ModelSizes:
    """The model's sizes in bytes, whatever its layout (global shapes).

    Attributes:
        parameters: every parameter.
        trainable: the parameters that require gradients.
        buffers: every buffer (never sharded).
        largest_block: the parameters of the largest block (FSDP2's unit).
        outside_blocks: the parameters in no block (the root's unit under FSDP2).
        largest_tensor: the largest single parameter.
    """

    parameters: int
    trainable: int
    buffers: int
    largest_block: int
    outside_blocks: int
    largest_tensor: int

    @classmethod
    def of(cls, module: nn.Module, blocks: Sequence[nn.Module]) -> ModelSizes:
        """The sizes of ``module`` (on any device, meta included) with these ``blocks``."""
        params = list(module.parameters())
        per_block = [sum(_bytes(p) for p in b.parameters()) for b in blocks]
        in_blocks = {id(p) for b in blocks for p in b.parameters()}
        return cls(
            parameters=sum(_bytes(p) for p in params),
            trainable=sum(_bytes(p) for p in params if p.requires_grad),
            buffers=sum(_bytes(b) for b in module.buffers()),
            largest_block=max(per_block, default=0),
            outside_blocks=sum(_bytes(p) for p in params if id(p) not in in_blocks),
            largest_tensor=max((_bytes(p) for p in params), default=0),
        )


def _bytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


@dataclass(frozen=True)
class Layout:
    """How the model is laid out over the ranks.

    Attributes:
        strategy: 'single', 'ddp', 'replicated' or 'fsdp'.
        shard: the ranks one copy is sharded over (1 unless FSDP2).
        replicate: the copies (HSDP), or the world under DDP.
        activation_checkpointing: 'none', 'full' or 'selective'.
        gathered_dtype_bytes: bytes per gathered parameter element over a parameter's (0.5
            with FSDP2's bf16 mixed precision on fp32 parameters).
        foreach: whether the optimizer steps every tensor at once (CUDA; the CPU steps them
            one by one).
        exact_micro_batches: in the reproducible mode, the most micro-batches one rank runs
            in a step (0: not the mode).
        fault_tolerant: a member of a fault-tolerant run (it keeps each step's sum for a redo).
    """

    strategy: str
    shard: int = 1
    replicate: int = 1
    activation_checkpointing: str = "none"
    gathered_dtype_bytes: float = 1.0
    foreach: bool = False
    exact_micro_batches: int = 0
    fault_tolerant: bool = False

    def describe(self) -> str:
        if self.strategy != "fsdp":
            text = f"{self.strategy} over {self.replicate} rank(s)"
        elif self.replicate > 1:
            text = f"fsdp (HSDP {self.replicate} x {self.shard}: replicate x shard)"
        else:
            text = f"fsdp over {self.shard} rank(s)"
        if self.activation_checkpointing != "none":
            text += f", {self.activation_checkpointing} activation checkpointing"
        return text


@dataclass(frozen=True)
class Activations:
    """Activations kept for backward by one micro-batch (bytes), per checkpointing mode."""

    none: int
    full: int
    selective: int

    def under(self, mode: str) -> int:
        return {"none": self.none, "full": self.full, "selective": self.selective}[mode]


@dataclass(frozen=True)
class MemoryPlan:
    """One rank's planned memory, item by item (name, bytes, how it was counted)."""

    layout: Layout
    items: tuple[tuple[str, int, str], ...]

    @property
    def total(self) -> int:
        """The peak: training's, validation's or a join's, the largest. Training's is every
        item but validation and a join, with the gradients and the activations counted as the
        larger of the two (backward frees a block's activations as it makes its gradients;
        both peak at different moments); validation's is every item but the activations, plus
        the evaluation pass's (the gradients are still held then); a join's, between two
        steps, every item but the gradients and activations, plus the state in flight."""
        sizes = {name: size for name, size, _ in self.items}
        validation, join = sizes.pop(VALIDATION, 0), sizes.pop(JOIN, 0)
        gradients, activations = sizes.get("gradients", 0), sizes.get("activations", 0)
        training = sum(sizes.values()) - min(gradients, activations)
        joining = sum(sizes.values()) - gradients - activations + join
        return max(training, sum(sizes.values()) - activations + validation, joining)

    def heading(self) -> str:
        """The line above the items."""
        return f"memory plan ({self.layout.describe()}), per rank:"


def gib(size: float) -> str:
    """A byte count for people: KiB below a MiB, MiB below a GiB, GiB above."""
    if size >= 2**30:
        return f"{size / 2**30:.2f} GiB"
    if size >= 2**20:
        return f"{size / 2**20:.1f} MiB"
    return f"{size / 2**10:.1f} KiB"


def optimizer_slots(optimizers: Sequence[torch.optim.Optimizer]) -> tuple[float, str]:
    """Optimizer state elements per trainable parameter element (the largest over the
    optimizers), and the optimizer's name: Adam-like 2 (3 with amsgrad), SGD 1 with
    momentum else 0, RMSprop 1 (+1 momentum, +1 centered), Adagrad 1; others assumed 2."""
    best, name = 0.0, "no optimizer"
    for optimizer in optimizers:
        options = optimizer.defaults
        kind = type(optimizer).__name__
        if kind in ("Adam", "AdamW", "NAdam", "RAdam", "Adamax"):
            slots = 3.0 if options.get("amsgrad") else 2.0
        elif kind == "SGD":
            slots = 1.0 if options.get("momentum") else 0.0
        elif kind == "RMSprop":
            slots = 1.0 + bool(options.get("momentum")) + bool(options.get("centered"))
        elif kind in ("Adagrad", "Adadelta"):
            slots = 1.0 if kind == "Adagrad" else 2.0
        else:
            slots, kind = 2.0, f"{kind} (assumed 2 slots)"
        if slots >= best:
            best, name = slots, kind
    return best, name


def plan_memory(
    sizes: ModelSizes,
    layout: Layout,
    slots: float,
    optimizer: str,
    activations: Activations | None,
    validation: bool = True,
) -> MemoryPlan:
    """The plan of ``layout`` for a model of ``sizes`` trained with ``slots`` optimizer
    state elements per parameter element; activations left out when not yet estimated, the
    validation pass when the run does not validate."""
    shard = layout.shard
    held = sizes.parameters // shard + sizes.buffers
    optimizer_state = int(slots * sizes.trainable) // shard
    items: list[tuple[str, int, str]] = [
        ("parameters", held, _split(shard) + ", buffers"),
        ("gradients", sizes.trainable // shard, _split(shard)),
        (
            "optimizer state",
            optimizer_state,
            f"{optimizer}, {slots:g} per parameter, {_split(shard)}",
        ),
    ]
    workspace = sizes.trainable // shard if layout.foreach else 2 * sizes.largest_tensor // shard
    items.append(("optimizer step workspace", workspace, _workspace_note(layout.foreach)))
    if layout.strategy == "fsdp":
        gathered = int(layout.gathered_dtype_bytes * sizes.largest_block)
        flight = BLOCKS_IN_FLIGHT * (gathered + sizes.largest_block) + 2 * sizes.outside_blocks
        items.append(
            (
                "communication buffers",
                flight,
                f"{BLOCKS_IN_FLIGHT} blocks' gathered parameters and unsharded gradients, and "
                f"the root's",
            )
        )
    elif layout.strategy == "ddp" and layout.replicate > 1:
        items.append(("communication buffers", sizes.trainable, "DDP's gradient buckets"))
    if layout.exact_micro_batches:
        items.append(("reproducible mode", *exact_mode_bytes(sizes.trainable, layout)))
        if layout.strategy != "fsdp":  # sharded: FSDP2's unsharded gradients, in the item
            items.append((MICRO_GRADIENTS, sizes.trainable, MICRO_GRADIENTS_NOTE))
        if layout.fault_tolerant:  # ExactStep.unsent: the int64 sum, whole (2T)
            items.append(("fault tolerance", 2 * sizes.trainable, FAULT_TOLERANCE_NOTE))
            items.append((JOIN, 2 * (held + optimizer_state), JOIN_NOTE))
    if activations is not None:
        kept = activations.under(layout.activation_checkpointing)
        how = f"one micro-batch, {layout.activation_checkpointing} checkpointing"
        items.append(("activations", kept, how))
        if validation:
            items.append((VALIDATION, activations.full, EVALUATION_NOTE))
    return MemoryPlan(layout, tuple(items))


def exact_mode_bytes(trainable: int, layout: Layout) -> tuple[int, str]:
    """What the reproducible mode's exact sum holds beyond the layout's own items, for
    ``trainable`` bytes of float32 parameters (T): the int64 accumulator the micro-batches
    are summed into as their backwards end and a float64 workspace (2T each; the scales are
    one float per tensor); sharded, also the whole unsharded gradients FSDP2 keeps for it
    (T), the reduce-scatter's padded input (2T) and what it receives (2T/shard). Measured
    against the buffers a step allocates in tests/distributed/test_reproducible_sharded.py,
    and against each rank's peak (benchmarks/memory_plan.py). Replicated, a micro-batch's own
    gradients while the step's flat one is kept for the optimizer are the plan's item
    ``MICRO_GRADIENTS``."""
    t, shard = trainable, layout.shard
    if layout.strategy != "fsdp":
        return 4 * t, "one int64 accumulator, one float64 workspace"
    held = 7 * t + 2 * t // shard
    return held, (
        "one int64 accumulator (whole) and its reduce-scatter's buffers, one float64 "
        "workspace, FSDP2's unsharded gradients"
    )


def _split(shard: int) -> str:
    return f"1/{shard} of the model's" if shard > 1 else "the whole model's"


def _workspace_note(foreach: bool) -> str:
    return "foreach step: one temporary per parameter" if foreach else "per-tensor step"


def fitting_layout(
    sizes: ModelSizes,
    layout: Layout,
    slots: float,
    optimizer: str,
    activations: Activations | None,
    world: int,
    budget: int,
    validation: bool = True,
) -> str:
    """A layout that would fit ``budget`` (for the error's "What would fit: ..."): full
    activation checkpointing, sharding over every rank, both, or the number of ranks FSDP2
    with full checkpointing needs."""
    candidates = []
    if layout.activation_checkpointing != "full" and activations is not None:
        recomputed = replace(layout, activation_checkpointing="full")
        candidates.append((recomputed, "fsdp.activation_checkpointing: full"))
    sharded = replace(layout, strategy="fsdp", shard=world, replicate=1)
    if layout.shard < world and world > 1:
        candidates.append((sharded, f"strategy: fsdp over all {world} ranks (fsdp.replicate: 1)"))
        if activations is not None:
            both = replace(sharded, activation_checkpointing="full")
            candidates.append((both, "strategy: fsdp over every rank with full checkpointing"))
    for candidate, how in candidates:
        total = plan_memory(sizes, candidate, slots, optimizer, activations, validation).total
        if total <= budget:
            return f"{how} ({gib(total)} per rank)"
    checkpointing = "full" if activations is not None else layout.activation_checkpointing
    for ranks in (2**k for k in range(1, 21)):
        candidate = replace(sharded, shard=ranks, activation_checkpointing=checkpointing)
        total = plan_memory(sizes, candidate, slots, optimizer, activations, validation).total
        if total <= budget:
            recompute = (
                f" with fsdp.activation_checkpointing: {checkpointing}"
                if checkpointing != "none"
                else ""
            )
            return f"strategy: fsdp over at least {ranks} ranks{recompute} ({gib(total)} per rank)"
    return "no layout of this model; a smaller model, micro-batch or optimizer state"


def check_budget(plan: MemoryPlan, budget: int, suggestion: str, source: str) -> None:
    """ConfigError when ``plan`` exceeds ``budget`` (``source``: where the budget comes from)."""
    if plan.total <= budget:
        return
    largest = max(plan.items, key=lambda item: item[1])
    raise ConfigError(
        f"the memory plan ({plan.layout.describe()}) needs {gib(plan.total)} per rank, more "
        f"than the budget of {gib(budget)} ({source}); the largest item is {largest[0]} "
        f"({gib(largest[1])}). What would fit: {suggestion}."
    )


__all__ = [
    "JOIN",
    "MICRO_GRADIENTS",
    "VALIDATION",
    "Activations",
    "Layout",
    "MemoryPlan",
    "ModelSizes",
    "check_budget",
    "exact_mode_bytes",
    "fitting_layout",
    "gib",
    "optimizer_slots",
    "plan_memory",
]
