"""FSDP2Strategy in a real 2-rank gloo group: the same parameters as DDP with batch B per rank
and as one process with 2B (accumulation with a partial last window, clipping), exact
evaluation with uneven ranks, the NaN guard agreed over shards, exact resume from a
checkpoint (a sharded folder; the EMA case writes one gathered file), and what is refused.

One spawned group runs every check; the single-process reference runs in the test process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import ConfigError, NNHandler
from nn_handler.strategies.fsdp import shard_blocks
from tests.distributed.test_trainer import EQUIVALENCE, NaNOnRankOne, _config
from tests.harness import run_group
from tests.training_helpers import max_difference, mlp, regression_data, sgd, state_of

pytestmark = pytest.mark.distributed

SHARDED = {"strategy": "fsdp", "gradient_clip_val": 0.5, "fsdp": {"blocks": ["Linear"]}}


def _full_state(handler: NNHandler) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True)  # every rank gets it (a collective)
    state = get_model_state_dict(handler.trainer.module, options=options)
    return {k: v.detach().clone() for k, v in state.items()}


def _fsdp_checks(rank: int, world_size: int, folder: str) -> dict[str, Any]:
    out: dict[str, Any] = {"folder": folder}
    val = regression_data(n=7, seed=1)  # 4 and 3 samples: the ranks run different batches
    with NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=_config(EQUIVALENCE, world_size, **SHARDED)
    ) as h:
        out["type"] = type(h.trainer.model).__name__
        out["local_numel"] = sum(p.to_local().numel() for p in h.trainer.module.parameters())
        h.train(regression_data(), epochs=2)
        out["fsdp"] = _full_state(h)
        out["fsdp_eval"] = h.evaluate(val)
        out["history"] = h.history.records[-1]["train_loss"]
    reduce_each = {**SHARDED, "fsdp": {"blocks": ["Linear"], "reduce_every_micro_batch": True}}
    with NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=_config(EQUIVALENCE, world_size, **reduce_each)
    ) as h:
        h.train(regression_data(), epochs=2)
        out["reduce_each"] = _full_state(h)
    ddp = {"gradient_clip_val": 0.5}
    with NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=_config(EQUIVALENCE, world_size, **ddp)
    ) as h:
        h.train(regression_data(), epochs=2)
        out["ddp"] = state_of(h.model)
        out["ddp_eval"] = h.evaluate(val)
    # Clipping by value (each element, each rank its shards) as under DDP; the whole weights
    # gathered by handler.full_state_dict (rank 0 only, as Accelerate's get_state_dict).
    value = {"gradient_clip_val": 0.02, "gradient_clip_algorithm": "value"}
    for strategy in ("fsdp", "ddp"):
        layout = {"strategy": "fsdp", "fsdp": {"blocks": ["Linear"]}} if strategy == "fsdp" else {}
        config = _config(EQUIVALENCE, world_size, **value, **layout)
        with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as h:
            h.train(regression_data(), epochs=1)
            out[f"value_{strategy}"] = _full_state(h) if strategy == "fsdp" else state_of(h.model)
            out[f"full_{strategy}"] = {k: v.clone() for k, v in h.full_state_dict().items()}
    # A NaN loss on rank 1 only: the step is skipped on both ranks (each checks its shard).
    with NNHandler(
        mlp(),
        sgd,
        nn.CrossEntropyLoss(),
        config=_config(EQUIVALENCE, world_size, **SHARDED),
        trainer_class=NaNOnRankOne,
    ) as h:
        h.train(regression_data(), epochs=1)
        out["skipped"] = h.history.records[0]["skipped_steps"]
    # Exact resume: one epoch, a checkpoint (a sharded folder: format 'auto' under FSDP2), a
    # fresh handler resumes it.
    path = Path(folder) / "fsdp.pt"
    with NNHandler(
        mlp(), torch.optim.Adam, nn.CrossEntropyLoss(), config=_config(EQUIVALENCE, 2, **SHARDED)
    ) as h:
        h.train(regression_data(), epochs=1)
        h.trainer.save_checkpoint(path)
        h.train(regression_data(), epochs=2)
        out["straight"] = _full_state(h)
    with NNHandler(
        mlp(seed=5),
        torch.optim.Adam,
        nn.CrossEntropyLoss(),
        config=_config(EQUIVALENCE, 2, **SHARDED),
    ) as h:
        h.trainer.resume(path)
        h.train(regression_data(), epochs=2)
        out["resumed"] = _full_state(h)
    out["gan"] = {strategy: _gan(rank, strategy) for strategy in ("fsdp", "ddp")}
    out["bf16"] = {mixed: _bf16(world_size, mixed) for mixed in (True, False)}
    # Across strategies: a DDP checkpoint resumed under FSDP, and the FSDP one under DDP.
    ddp_path = Path(folder) / "ddp.pt"
    adam_ddp = _config(EQUIVALENCE, 2)
    with NNHandler(mlp(), torch.optim.Adam, nn.CrossEntropyLoss(), config=adam_ddp) as h:
        h.train(regression_data(), epochs=1)
        h.trainer.save_checkpoint(ddp_path)
        h.train(regression_data(), epochs=2)
        out["ddp_straight"] = state_of(h.model)
    sharded = _config(EQUIVALENCE, 2, strategy="fsdp", fsdp={"blocks": ["Linear"]})
    with NNHandler(mlp(seed=5), torch.optim.Adam, nn.CrossEntropyLoss(), config=sharded) as h:
        h.trainer.resume(ddp_path)
        h.train(regression_data(), epochs=2)
        out["ddp_to_fsdp"] = _full_state(h)
    clipped_ddp = _config(EQUIVALENCE, 2, gradient_clip_val=0.5)  # as the FSDP run was
    with NNHandler(mlp(seed=5), torch.optim.Adam, nn.CrossEntropyLoss(), config=clipped_ddp) as h:
        h.trainer.resume(path)  # written under FSDP
        h.train(regression_data(), epochs=2)
        out["fsdp_to_ddp"] = state_of(h.model)
    out["ema"] = {strategy: _ema(strategy, val, Path(folder)) for strategy in ("fsdp", "ddp")}
    out["view_warnings"] = _view_warnings(world_size)
    return out


class ViewOut(nn.Module):
    """Returns a view of its output (a slice): torch's FSDP2 warns about in-place ops on it."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)[:, :3]


def _view_warnings(world_size: int) -> int:
    """How many times this rank shows torch's 'returned a view tensor' warning."""
    import warnings

    config = _config(EQUIVALENCE, world_size, strategy="fsdp")
    with (
        warnings.catch_warnings(record=True) as seen,
        NNHandler(ViewOut(), sgd, nn.CrossEntropyLoss(), config=config) as h,
    ):
        h.train(regression_data(n=16), epochs=1)
    return sum("returned a view tensor" in str(w.message) for w in seen)


def _ema(strategy: str, val: Any, folder: Path) -> dict[str, Any]:
    """EMA on (decay 0.9, validated with): its weights, validation with it, and a resume
    from a checkpoint that holds it."""
    data = _config(EQUIVALENCE, 2).model_dump()
    data["ema"] = {"enabled": True, "decay": 0.9}
    data["checkpoint"] = {"format": "file"}  # one file: the EMA gathered whole, like the model
    if strategy == "fsdp":
        data["trainer"].update(strategy="fsdp", fsdp={"blocks": ["Linear"]})
    seen: dict[str, Any] = {}
    path = folder / f"ema-{strategy}.pt"
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=data) as h:
        h.train(regression_data(), val, epochs=1)
        h.trainer.save_checkpoint(path)
        h.train(regression_data(), val, epochs=2)
        ema = h.trainer.ema
        assert ema is not None
        seen["weights"] = ema.state_dict()["module"]  # gathered to rank 0 under FSDP
        seen["val"] = h.history.records[-1]["val_loss"]
        seen["plain"] = h.evaluate(val, use_ema=False)
    with NNHandler(mlp(seed=5), sgd, nn.CrossEntropyLoss(), config=data) as h:
        h.trainer.resume(path)
        h.train(regression_data(), val, epochs=2)
        seen["resumed_val"] = h.history.records[-1]["val_loss"]
        seen["resumed_weights"] = h.trainer.ema.state_dict()["module"]  # type: ignore[union-attr]
    return seen


def _bf16(world_size: int, mixed: bool) -> dict[str, Any]:
    """precision bf16: the dtype a block's weight has inside its forward, and the shards';
    a BatchNorm layer's weight inside its forward (fp32: CUDA's batch norm refuses bf16
    weights beside its fp32 running statistics)."""
    trainer = {**SHARDED, "fsdp": {"blocks": ["Linear"], "mixed_precision": mixed}}
    config = _config(EQUIVALENCE, world_size, **trainer).model_dump()
    config["precision"] = "bf16"
    inside: set[str] = set()
    norm: set[str] = set()
    with NNHandler(mlp(batchnorm=True), sgd, nn.CrossEntropyLoss(), config=config) as h:
        modules = list(h.trainer.module.modules())
        block = next(m for m in modules if isinstance(m, nn.Linear))
        block.register_forward_pre_hook(lambda m, _: inside.add(str(m.weight.dtype)))
        layer = next(m for m in modules if isinstance(m, nn.BatchNorm1d))
        layer.register_forward_pre_hook(lambda m, _: norm.add(str(m.weight.dtype)))
        h.train(regression_data(), epochs=1)
        shard = next(h.trainer.module.parameters())
        loss = h.history.last["train_loss"]
        return {"inside": inside, "norm": norm, "shard": str(shard.dtype), "loss": loss}


def _gan(rank: int, strategy: str) -> dict[str, torch.Tensor]:
    """Manual optimization (two optimizers, two backwards per step) with each network one
    FSDP unit."""
    from tests.gan_helpers import GANTrainer, TinyGAN, ring_data

    torch.manual_seed(10 + rank)  # each rank its own noise
    trainer = {"progress_bar": False, "strategy": strategy, "fsdp": {"blocks": ["Sequential"]}}
    if strategy == "ddp":
        trainer = {"progress_bar": False, "find_unused_parameters": True}
    with NNHandler(
        TinyGAN(),
        config={"loader": {"batch_size": 8}, "trainer": trainer},
        trainer_class=GANTrainer,
    ) as h:
        h.train(ring_data(), epochs=1)
        return _full_state(h) if strategy == "fsdp" else state_of(h.model)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    folder = tmp_path_factory.mktemp("fsdp")
    return run_group(_fsdp_checks, 2, args=(str(folder),), timeout=240)


def test_the_model_is_sharded_over_the_ranks(results: list[dict[str, Any]]) -> None:
    total = sum(p.numel() for p in mlp().parameters())
    for seen in results:
        assert seen["type"] == "FSDPSequential"
        assert seen["local_numel"] < total  # each rank holds a shard (padded to even splits)
    assert sum(r["local_numel"] for r in results) >= total


def test_fsdp_trains_like_ddp_and_like_one_process_with_the_whole_batch(
    results: list[dict[str, Any]],
) -> None:
    reference = NNHandler(
        mlp(), sgd, nn.CrossEntropyLoss(), config=_config(EQUIVALENCE, 1, gradient_clip_val=0.5)
    )
    reference.train(regression_data(), epochs=2)
    one_process = state_of(reference.model)
    reference.close()
    for seen in results:
        assert max_difference(seen["fsdp"], seen["ddp"]) < 1e-6
        assert max_difference(seen["fsdp"], one_process) < 1e-5
        assert max_difference(seen["reduce_each"], seen["fsdp"]) < 1e-6
    assert results[0]["history"] == results[1]["history"]


def test_clipping_by_value_and_the_full_state_dict_under_fsdp(
    results: list[dict[str, Any]],
) -> None:
    config = _config(EQUIVALENCE, 1, gradient_clip_val=0.02, gradient_clip_algorithm="value")
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as reference:
        reference.train(regression_data(), epochs=1)
        one_process = state_of(reference.model)
    norm_clipped = _config(EQUIVALENCE, 1, gradient_clip_val=0.02)
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=norm_clipped) as other:
        other.train(regression_data(), epochs=1)
        assert max_difference(state_of(other.model), one_process) > 1e-3  # not the norm's
    for seen in results:
        assert max_difference(seen["value_fsdp"], seen["value_ddp"]) < 1e-6
        assert max_difference(seen["value_fsdp"], one_process) < 1e-5
        assert max_difference(seen["full_ddp"], seen["value_ddp"]) == 0.0  # every rank's own
    assert max_difference(results[0]["full_fsdp"], results[0]["value_fsdp"]) == 0.0
    assert results[1]["full_fsdp"] == {}  # gathered to rank 0 only


def test_exact_evaluation_with_uneven_ranks_matches_ddp(results: list[dict[str, Any]]) -> None:
    for seen in results:
        assert seen["fsdp_eval"] == seen["ddp_eval"]


def test_a_nan_on_one_rank_is_skipped_on_every_rank(results: list[dict[str, Any]]) -> None:
    assert [r["skipped"] for r in results] == [1.0, 1.0]


def test_a_checkpoint_resumes_bit_identical(results: list[dict[str, Any]]) -> None:
    for seen in results:
        assert max_difference(seen["resumed"], seen["straight"]) == 0.0


def test_a_gan_with_manual_optimization_trains_like_under_ddp(
    results: list[dict[str, Any]],
) -> None:
    for seen in results:
        assert max_difference(seen["gan"]["fsdp"], seen["gan"]["ddp"]) < 1e-5
    assert max_difference(results[0]["gan"]["fsdp"], results[1]["gan"]["fsdp"]) == 0.0


def test_bf16_gathers_bf16_parameters_and_keeps_fp32_shards(
    results: list[dict[str, Any]],
) -> None:
    """FSDP2's MixedPrecisionPolicy with precision bf16: each block computes with bf16
    parameters (half the all-gather bytes); the shards (and so the gradients and optimizer
    state) stay fp32; fsdp.mixed_precision=False keeps fp32 parameters under autocast.
    BatchNorm layers compute with fp32 parameters either way."""
    for seen in results:
        mixed, plain = seen["bf16"][True], seen["bf16"][False]
        assert mixed["inside"] == {"torch.bfloat16"} and mixed["shard"] == "torch.float32"
        assert plain["inside"] == {"torch.float32"} and plain["shard"] == "torch.float32"
        assert mixed["norm"] == plain["norm"] == {"torch.float32"}
        assert abs(mixed["loss"] - plain["loss"]) < 0.05  # both bf16 matmuls under autocast


def test_checkpoints_move_between_ddp_and_fsdp(results: list[dict[str, Any]]) -> None:
    """The model's weights have the same plain keys under both; the optimizer state is keyed
    by index under DDP and by name under FSDP, and converted when loaded."""
    for seen in results:
        assert max_difference(seen["ddp_to_fsdp"], seen["ddp_straight"]) < 1e-6
        assert max_difference(seen["fsdp_to_ddp"], seen["straight"]) < 1e-6


def test_an_fsdp_checkpoint_resumes_in_one_process(results: list[dict[str, Any]]) -> None:
    folder = results[0]["folder"]
    config = _config(EQUIVALENCE, 1, **{**SHARDED, "strategy": "auto"})
    with NNHandler(mlp(seed=5), torch.optim.Adam, nn.CrossEntropyLoss(), config=config) as h:
        h.trainer.resume(Path(folder) / "fsdp.pt", allow_world_size_change=True)
        assert h.trainer.state.epoch == 1
        steps = {int(s["step"]) for s in h.trainer.optimizer.state_dict()["state"].values()}
        # Adam's state came along: 3 steps in the first epoch (5 batches, windows of 2).
        assert steps == {3}
        h.train(regression_data(), epochs=2)
        assert h.trainer.state.global_step == 6


def test_the_ema_stays_sharded_and_averages_like_ddps(results: list[dict[str, Any]]) -> None:
    """One averaged shard per rank, swapped in to validate and gathered whole to save: the
    same EMA weights and EMA validation as DDP's full copy, and an exact resume."""
    first = results[0]["ema"]
    assert max_difference(first["fsdp"]["weights"], first["ddp"]["weights"]) < 1e-6
    assert max_difference(first["fsdp"]["resumed_weights"], first["fsdp"]["weights"]) == 0.0
    for seen in results:
        fsdp, ddp = seen["ema"]["fsdp"], seen["ema"]["ddp"]
        assert abs(fsdp["val"] - ddp["val"]) < 1e-6
        assert fsdp["resumed_val"] == fsdp["val"]
        assert fsdp["plain"] != {"loss": fsdp["val"]}  # the training weights are back
    assert results[1]["ema"]["fsdp"]["weights"] == {}  # only rank 0 holds the gathered state


def test_fsdp_without_a_process_group_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="strategy 'fsdp' shards the model over a process"):
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config={"trainer": {"strategy": "fsdp"}})


def test_cpu_offload_on_the_cpu_is_a_config_error() -> None:
    config = {"trainer": {"strategy": "fsdp", "fsdp": {"cpu_offload": True}}}
    with pytest.raises(ConfigError, match="device is the CPU already: leave cpu_offload off"):
        NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config)


def test_blocks_are_chosen_bottom_up_by_class_or_by_size() -> None:
    model = nn.Sequential(
        nn.Sequential(nn.Linear(10, 10), nn.Linear(10, 10)), nn.Linear(10, 2), nn.ReLU()
    )
    by_class = shard_blocks(model, ["Linear"], 1)
    assert by_class == [model[0][0], model[0][1], model[1]]
    # 110 parameters per inner Linear, 220 in the inner Sequential, 22 in the last Linear:
    # the innermost modules that are big enough.
    assert shard_blocks(model, [], 200) == [model[0]]
    assert shard_blocks(model, [], 100) == [model[0][0], model[0][1]]
    assert shard_blocks(model, [], 10_000) == []


def test_torchs_view_output_warning_is_shown_once_in_all(results: list[dict[str, Any]]) -> None:
    assert [r["view_warnings"] for r in results] == [1, 0]
