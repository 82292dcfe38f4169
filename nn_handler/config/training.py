"""Configuration of the training loop: trainer, precision, EMA, early stopping."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import ByteSize, Field, StrictBool, field_validator, model_validator

from nn_handler.config.base import ConfigModel
from nn_handler.config.fault_tolerance import FaultToleranceConfig
from nn_handler.config.observability import ProfileConfig

PrecisionName = Literal["32", "bf16", "fp16", "amp"]
Interval = Literal["epoch", "step"]
StrategyName = Literal["auto", "single", "ddp", "fsdp"]
NonFinitePolicy = Literal["skip", "raise", "off"]
ActivationCheckpointing = Literal["none", "full", "selective"]
MeshSize = int | Literal["auto"]
Mode = Literal["min", "max"]


class PrecisionConfig(ConfigModel):
    """Numerical precision of forward and backward.

    Attributes:
        precision: '32' (full precision), 'bf16' (torch.autocast to bfloat16, CPU and CUDA),
            'fp16' (autocast to float16 with a torch.amp.GradScaler; CUDA only: on CPU it is a
            ConfigError) or 'amp' (seed 003's ``use_amp=True``: fp16 on CUDA, bf16 elsewhere).
        init_scale: the GradScaler's initial loss scale (fp16 only).
        growth_interval: steps without overflow before the GradScaler grows the scale.
    """

    precision: PrecisionName = "32"
    init_scale: float = Field(default=2.0**16, gt=0)
    growth_interval: int = Field(default=2000, ge=1, strict=True)


class EmaConfig(ConfigModel):
    """Exponential moving average of the weights (seed 003's ``use_ema``/``ema_decay``).

    Attributes:
        enabled: keep an EMA copy of the model.
        decay: ``ema = decay * ema + (1 - decay) * weights`` at every update.
        warmup: use ``min(decay, (1 + n) / (10 + n))`` for the n-th update, so the EMA is not
            dominated by the initial weights early in training (on by default, as timm's
            ModelEmaV3 ``use_warmup``: with decay 0.9999 and no warm-up, the EMA of a run of a
            few thousand steps is still mostly its initial weights).
        update_every: update after every N-th optimizer step.
        start_step: the first optimizer step that updates the EMA (before it, the EMA copies
            the weights).
        buffers: 'copy' the model's buffers (BatchNorm statistics) into the EMA, or 'average'
            the floating-point ones like the weights.
        validate_with_ema: run validation on the EMA weights.
    """

    enabled: StrictBool = False
    decay: float = Field(default=0.9999, gt=0.0, lt=1.0)
    warmup: StrictBool = True
    update_every: int = Field(default=1, ge=1, strict=True)
    start_step: int = Field(default=0, ge=0, strict=True)
    buffers: Literal["copy", "average"] = "copy"
    validate_with_ema: StrictBool = True


class EarlyStoppingConfig(ConfigModel):
    """Stop when a monitored epoch metric stops improving (the same decision on every rank).

    Attributes:
        monitor: a History key such as 'val_loss' or 'val_accuracy'.
        mode: 'min' when lower is better, 'max' when higher is better.
        patience: epochs without improvement before stopping.
        min_delta: the smallest change that counts as an improvement.
    """

    monitor: str = "val_loss"
    mode: Mode = "min"
    patience: int = Field(default=5, ge=1, strict=True)
    min_delta: float = Field(default=0.0, ge=0.0)


class FsdpConfig(ConfigModel):
    """How ``strategy: fsdp`` shards the model with FSDP2 (``torch.distributed.fsdp.
    fully_shard``): every block is a unit whose parameters are all-gathered for its forward and
    backward and whose gradients are reduce-scattered; the root module is sharded last.

    Attributes:
        blocks: the class names of the modules to shard one by one (for example
            ``["TransformerEncoderLayer"]``); empty: the innermost modules with at least
            ``min_params`` parameters (a module that holds one is not a block itself).
        min_params: the size of a block when ``blocks`` is empty.
        reshard_after_forward: free each block's gathered parameters after its forward and
            gather them again in backward (less memory, more communication).
        cpu_offload: keep the sharded parameters, gradients and optimizer state in CPU memory
            (FSDP2's CPUOffloadPolicy).
        reduce_every_micro_batch: with gradient accumulation, reduce-scatter the gradients of
            every micro-batch (sharded gradients: less memory, one reduce-scatter per
            micro-batch) instead of only on the last one of a window (unsharded gradients
            accumulate: more memory, one reduce-scatter per optimizer step).
        mixed_precision: with ``precision: bf16``, FSDP2's MixedPrecisionPolicy: the gathered
            parameters are bf16 for forward and backward (half the all-gather bytes), the
            gradients are reduced in fp32, and the shards, gradients and optimizer state stay
            fp32. False: fp32 parameters under autocast, as under DDP.
        replicate: HSDP's replica count: the ranks form a ``replicate x shard`` device mesh;
            each group of ``shard`` ranks holds one sharded copy of the model (parameters
            all-gathered and gradients reduce-scattered inside it), and the copies average
            their gradients across groups. 1 (the default): plain FSDP over every rank.
            'auto': the number of machines (with ``shard: auto``) or world / shard.
        shard: the ranks one copy is sharded over; 'auto' (the default): world / replicate,
            or, with ``replicate: auto``, the ranks of one machine.
        activation_checkpointing: recompute each block's activations in backward instead of
            keeping them ('full': keep only each block's input; 'selective': keep the
            outputs of matrix multiplications and attention, recompute the cheap operators);
            'none': keep everything. It applies under every strategy, to the blocks that
            ``blocks`` (or ``min_params``) chooses; the gradients are the same.
    """

    blocks: list[str] = Field(default_factory=list)
    min_params: int = Field(default=1_000_000, ge=1, strict=True)
    reshard_after_forward: StrictBool = True
    cpu_offload: StrictBool = False
    reduce_every_micro_batch: StrictBool = False
    mixed_precision: StrictBool = True
    replicate: MeshSize = 1
    shard: MeshSize = "auto"
    activation_checkpointing: ActivationCheckpointing = "none"

    @field_validator("replicate", "shard", mode="before")
    @classmethod
    def _check_mesh_size(cls, value: object) -> object:
        if isinstance(value, bool) or (isinstance(value, int) and value < 1):
            raise ValueError(f"a mesh size is a number of ranks >= 1 or 'auto', got {value!r}")
        return value


class ReproducibleConfig(ConfigModel):
    """Bit-identical training at any world size (docs/reproducible.md): the same weights,
    optimizer state, buffers and History from 1, 2, 3 or more ranks, and through a resume at
    another world size.

    Attributes:
        global_batch_size: samples per optimizer step, whatever the number of ranks.
        micro_batch_size: samples per forward and backward: the unit a rank owns (micro-batch
            ``j`` of a step runs on rank ``j % world_size``). ``global_batch_size`` must be a
            multiple of it.
        seed: the seed of every micro-batch's random stream (dropout), drawn from (seed,
            optimizer step, micro-batch index), never from the rank.
        reduction: 'exact': the gradients summed in fixed point (int64), the same bits at any
            world size; 'float': summed in floating point (float64, one all_reduce, no
            scales), the mode's fixed batches and seeds kept: the weights at another world
            size (or after a fault-tolerant run lost a member) match to float tolerance, not
            bitwise. Faster where the quantisation weighs (small models, GPUs).
    """

    global_batch_size: int = Field(ge=1, strict=True)
    micro_batch_size: int = Field(ge=1, strict=True)
    seed: int = Field(default=0, ge=0, strict=True)
    reduction: Literal["exact", "float"] = "exact"

    @model_validator(mode="after")
    def _check_sizes(self) -> ReproducibleConfig:
        if self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"global_batch_size={self.global_batch_size} is not a multiple of "
                f"micro_batch_size={self.micro_batch_size}; every optimizer step is cut into "
                f"whole micro-batches"
            )
        return self

    @property
    def micro_batches(self) -> int:
        """Micro-batches per optimizer step."""
        return self.global_batch_size // self.micro_batch_size


class TrainerConfig(ConfigModel):
    """How the Trainer runs the loop.

    Attributes:
        epochs: default number of epochs for ``train`` (its ``epochs`` argument overrides it).
        accumulate_grad_batches: micro-batches per optimizer step. Gradients synchronise only
            on the last micro-batch of each window; the last, possibly shorter, window of an
            epoch also steps and synchronises.
        gradient_clip_val: clip the gradients to this value (after unscaling under fp16): their
            norm (the whole model's, on every rank alike), or each element (``value``).
        gradient_clip_algorithm: 'norm' (clip_grad_norm_) or 'value' (clip_grad_value_:
            every gradient element into [-gradient_clip_val, gradient_clip_val]), Lightning's
            names.
        gradient_clip_norm_type: the p of the clipped p-norm.
        scheduler_interval: step the LR scheduler every 'epoch' or every optimizer 'step'.
        scheduler_monitor: the History key given to ReduceLROnPlateau-style schedulers.
        strategy: how the model is parallelised (nn_handler/strategies/): 'ddp' wraps it in
            DistributedDataParallel (needs a process group), 'single' trains one replica as it
            is (one rank only), 'fsdp' shards parameters, gradients and optimizer state over
            the ranks with FSDP2 (needs a process group; see ``fsdp``), 'auto' picks 'ddp'
            when the run has more than one rank and a process group, 'single' otherwise.
        fsdp: the sharding of ``strategy: fsdp`` (FsdpConfig).
        sync_batchnorm: convert BatchNorm layers to synchronised ones when world size > 1.
        compile: wrap the model with torch.compile (``compile_kwargs`` are passed through);
            'blocks': compile each block (``fsdp.blocks``, or by ``fsdp.min_params``) on its
            own, under every strategy: one small graph compiled once and reused per block,
            composed with FSDP2 and activation checkpointing.
        init_weights: a file or sharded checkpoint folder whose weights the model starts from
            (a state dict saved with torch.save, a checkpoint file or a sharded checkpoint
            folder: its ``model``), loaded into each rank's shards without the whole model
            on any rank (a file is memory-mapped). None: a model built on the meta device is
            initialised by each module's ``reset_parameters``, seeded by ``init_seed`` and
            the module's name (the same weights under every strategy and world size); any
            other model keeps the weights it was built with.
        init_seed: the seed of that initialisation.
        memory_budget: the memory one rank may use ("40GiB", "512MB" or bytes); the memory
            plan printed at the start is checked against it (ConfigError naming a layout
            that would fit). None: the device's memory (a GPU's total, or on the CPU the
            machine's memory divided by its ranks).
        find_unused_parameters: passed to DistributedDataParallel.
        nonfinite: what to do when any rank's loss or gradients are NaN/inf before a step:
            'skip' the step on every rank (and log it), 'raise' on every rank, or 'off'.
            A skipped step leaves the weights, the optimizer's state and every buffer
            (BatchNorm statistics) as they were before it, and its losses are left out of the
            epoch's train_loss; the global step, a per-step schedule and the EMA go on. With
            a fused optimizer ('skip' only) the step is skipped on the device, with no host
            read, and counted at the next log step; otherwise the verdict costs one host read
            per optimizer step.
        max_consecutive_skipped_steps: with nonfinite='skip', raise NonFiniteError on every
            rank after this many skipped optimizer steps in a row (None: never), so a run
            that has diverged stops instead of skipping every step silently (a verdict
            decided on the device: at the log step after the limit).
        early_stopping: stop on a monitored metric (None: never).
        max_steps: stop once this many optimizer steps are done in total (None: no limit),
            also in the middle of an epoch.
        limit_train_batches: train on this many batches per epoch (an int), or this fraction
            of each rank's batches (a float in (0, 1]); None: all.
        limit_val_batches: the same for validation (per rank: the metrics are then those of
            the batches seen, exact over them).
        max_time: stop the fit once this much wall-clock time has passed since it started
            (seconds, or Lightning's "DD:HH:MM:SS"), on every rank at the same step (checked
            every log_every_n_steps optimizer steps and at each epoch's end), as max_steps
            would: a mid-epoch stop keeps its position (save_last), and a later fit continues.
            None: no limit.
        val_check_interval: also validate inside each epoch: every this many training batches
            (an int, a multiple of accumulate_grad_batches) or this fraction of the epoch (a
            float in (0, 1]; needs a loader with len()). Each mid-epoch result goes to the
            ``after_validation`` hooks and one log line; the epoch record (and early stopping,
            save_best, ReduceLROnPlateau) keeps the end-of-epoch validation. None: at the end
            of each epoch only.
        check_val_every_n_epoch: validate at the end of every n-th epoch only (Lightning's
            name; its val_check_interval points too); the epochs between have no ``val_``
            keys, and early stopping, save_best and ReduceLROnPlateau on a ``val_`` key skip
            them.
        num_sanity_val_steps: before training, run this many batches of each validation set
            (Lightning's sanity check; -1: all of them), so that a broken validation_step
            fails in seconds on every rank instead of after the first epoch; nothing is
            recorded. 0: off (Lightning's default is 2).
        fast_dev_run: a smoke run of the whole loop: this many training and validation
            batches, one epoch, and no checkpoint written or resumed (0: off).
        log_every_n_steps: how often the rank-0 progress bar shows the running loss and the
            host reads the non-finite guard's verdicts decided on the device (the loop's host
            synchronisations with a fused optimizer).
        progress_bar: a tqdm bar on rank 0.
        model_summary: print the model's parameters (trainable, frozen, their memory) per
            top-level module once, when the Trainer is built (rank 0).
        non_blocking: copy batches to the device asynchronously (with pinned memory).
        profile: profile a few training steps with torch.profiler (ProfileConfig: Chrome
            traces per rank, a table of the top operators); None: off.
        reproducible: bit-identical training at any world size (ReproducibleConfig), the
            model replicated or sharded (``strategy: fsdp``: an int64 reduce-scatter); None:
            off (the normal mode, a floating-point all_reduce of the gradients).
        fault_tolerance: a member lost in a step is left out and its step redone by the
            others, with no restart (FaultToleranceConfig; needs ``reproducible``, with either
            reduction); None: off.
    """

    epochs: int = Field(default=1, ge=1, strict=True)
    accumulate_grad_batches: int = Field(default=1, ge=1, strict=True)
    gradient_clip_val: float | None = Field(default=None, gt=0)
    gradient_clip_algorithm: Literal["norm", "value"] = "norm"
    gradient_clip_norm_type: float = Field(default=2.0, gt=0)
    scheduler_interval: Interval = "epoch"
    scheduler_monitor: str = "val_loss"
    strategy: StrategyName = "auto"
    fsdp: FsdpConfig = Field(default_factory=FsdpConfig)
    sync_batchnorm: StrictBool = False
    compile: StrictBool | Literal["blocks"] = False
    compile_kwargs: dict[str, Any] = Field(default_factory=dict)
    init_weights: str | None = None
    init_seed: int = Field(default=0, ge=0, lt=2**63, strict=True)
    memory_budget: ByteSize | None = None
    find_unused_parameters: StrictBool = False
    nonfinite: NonFinitePolicy = "skip"
    max_consecutive_skipped_steps: int | None = Field(default=10, ge=1, strict=True)
    early_stopping: EarlyStoppingConfig | None = None
    max_steps: int | None = Field(default=None, ge=1, strict=True)
    max_time: float | None = Field(default=None, gt=0)
    limit_train_batches: int | float | None = Field(default=None, gt=0)
    limit_val_batches: int | float | None = Field(default=None, gt=0)
    val_check_interval: int | float | None = Field(default=None, gt=0)
    check_val_every_n_epoch: int = Field(default=1, ge=1, strict=True)
    num_sanity_val_steps: int = Field(default=0, ge=-1, strict=True)
    fast_dev_run: int = Field(default=0, ge=0, strict=True)

    @field_validator("max_time", mode="before")
    @classmethod
    def _parse_max_time(cls, value: object) -> object:
        return parse_max_time(value)

    @field_validator(
        "limit_train_batches", "limit_val_batches", "val_check_interval", mode="before"
    )
    @classmethod
    def _check_limit(cls, value: object) -> object:
        if isinstance(value, bool):
            raise ValueError("a limit is a number of batches (int) or a fraction (float)")
        if isinstance(value, float) and value > 1.0:
            raise ValueError(
                f"a fraction of the batches must be at most 1.0, got {value}; pass an int "
                f"for a number of batches"
            )
        return value

    log_every_n_steps: int = Field(default=50, ge=1, strict=True)
    progress_bar: StrictBool = True
    model_summary: StrictBool = True
    non_blocking: StrictBool = True
    profile: ProfileConfig | None = None
    reproducible: ReproducibleConfig | None = None
    fault_tolerance: FaultToleranceConfig | None = None

    @model_validator(mode="after")
    def _check_reproducible(self) -> TrainerConfig:
        if self.fault_tolerance is not None and self.reproducible is None:
            raise ValueError(
                "fault_tolerance: needs reproducible (a step's samples must not depend on "
                "the members, so that a step redone by fewer members uses each sample once): "
                "set trainer.reproducible (global_batch_size, micro_batch_size; reduction "
                "'float' for a floating-point sum, whose weights then match an unfailed run "
                "to float tolerance instead of bitwise)"
            )
        if self.reproducible is None:
            return self
        refused = {
            "accumulate_grad_batches": (
                self.accumulate_grad_batches != 1,
                "the mode cuts each step into micro-batches itself (global_batch_size / "
                "micro_batch_size); leave accumulate_grad_batches at 1",
            ),
            "strategy": (
                self.strategy == "single",
                "strategy 'single' is not supported: the mode sums gradients over the ranks "
                "itself; use 'auto' or 'ddp' (the model replicated) or 'fsdp' (sharded)",
            ),
            "reduction": (
                self.strategy == "fsdp" and self.reproducible.reduction == "float",
                "'float' with strategy 'fsdp' is FSDP2's own reduce-scatter: leave "
                "reproducible unset for it, or keep reduction 'exact' (an exact int64 "
                "reduce-scatter)",
            ),
            "max_time": (
                self.fault_tolerance is not None and self.max_time is not None,
                "each member of a fault-tolerant run would stop on its own clock (a member that "
                "stops leaves the run); stop the run from outside (its supervisor's time limit, "
                "SIGTERM: an emergency checkpoint) or use max_steps",
            ),
            "fault_tolerance": (
                self.strategy == "fsdp" and self.fault_tolerance is not None,
                "a member that joins receives the whole state from one live member, and with "
                "strategy 'fsdp' no member holds it whole: use 'auto' or 'ddp' (replicated), "
                "or leave fault_tolerance unset (a sharded run restarts from its checkpoint)",
            ),
            "limit_val_batches": (
                self.limit_val_batches is not None,
                "it limits each rank's share of the validation batches, so which batches count "
                "would depend on the world size; leave it unset",
            ),
            "sync_batchnorm": (
                self.sync_batchnorm,
                "SyncBatchNorm averages statistics over ranks in floating point and needs as "
                "many forwards on every rank; the mode keeps BatchNorm statistics exact per "
                "micro-batch instead: set sync_batchnorm=False",
            ),
        }
        for name, (bad, why) in refused.items():
            if bad:
                raise ValueError(f"reproducible: {name}: {why}")
        return self

    @model_validator(mode="after")
    def _check_val_interval(self) -> TrainerConfig:
        interval, accumulate = self.val_check_interval, self.accumulate_grad_batches
        if isinstance(interval, int) and interval % accumulate:
            raise ValueError(
                f"val_check_interval={interval} batches ends inside an accumulation window of "
                f"accumulate_grad_batches={accumulate}; use a multiple of {accumulate}"
            )
        return self


def parse_max_time(value: object) -> object:
    """``max_time`` as seconds: a number of seconds, or Lightning's "DD:HH:MM:SS" string (also
    "HH:MM:SS" and "MM:SS"); anything else is left for the field's own check."""
    if not isinstance(value, str):
        return value
    parts = value.split(":")
    if not 1 < len(parts) <= 4 or not all(p.strip().isdigit() for p in parts):
        raise ValueError(f"max_time is seconds or 'DD:HH:MM:SS', got {value!r}")
    seconds = 0
    for part, unit in zip(reversed(parts), (1, 60, 3600, 86400), strict=False):
        seconds += int(part) * unit
    return float(seconds)


__all__ = [
    "ActivationCheckpointing",
    "EarlyStoppingConfig",
    "EmaConfig",
    "FsdpConfig",
    "Interval",
    "Mode",
    "NonFinitePolicy",
    "PrecisionConfig",
    "PrecisionName",
    "ReproducibleConfig",
    "StrategyName",
    "TrainerConfig",
]
