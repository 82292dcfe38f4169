"""Large-model features in one process: meta-device initialisation, weights loaded from a
file, activation checkpointing and per-block compile (same gradients), the activation
estimate and the memory plan, and every error path they add."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import CheckpointError, ConfigError, NNHandler
from nn_handler.config import TrainerConfig
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.strategies import select_strategy
from nn_handler.strategies.activation_estimate import estimate_activations, meta_twin
from nn_handler.strategies.memory_plan import (
    Activations,
    Layout,
    ModelSizes,
    check_budget,
    fitting_layout,
    optimizer_slots,
    plan_memory,
)
from nn_handler.strategies.mesh import mesh_shape
from tests.large_model_helpers import adam, blocks_data, blocks_model

CPU = torch.device("cpu")
MiB = 2**20


def _setup(model: nn.Module, **trainer: Any) -> nn.Module:
    config = TrainerConfig(**trainer)
    strategy = select_strategy(NullCommunicator(), CPU, config)
    return strategy.setup(model)[0]


# ------------------------------------------------------------------ meta-device models
def test_a_meta_model_is_initialised_the_same_way_every_time_and_per_seed() -> None:
    first = _setup(blocks_model()).state_dict()
    again = _setup(blocks_model()).state_dict()
    other = _setup(blocks_model(), init_seed=1).state_dict()
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not torch.equal(first["1.linear.weight"], other["1.linear.weight"])
    assert torch.equal(first["1.norm.weight"], torch.ones(16))  # LayerNorm's own reset
    bound = 1 / 16**0.5  # Linear's kaiming-uniform bound for 16 inputs
    assert first["1.linear.weight"].abs().max() <= bound
    assert first["1.linear.weight"].std() > bound / 3


def test_batchnorm_statistics_of_a_meta_model_start_as_a_new_layer() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    state = _setup(model).state_dict()
    assert torch.equal(state["1.running_var"], torch.ones(4))
    assert torch.equal(state["1.running_mean"], torch.zeros(4))
    assert int(state["1.num_batches_tracked"]) == 0


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gain


def test_a_meta_module_without_reset_parameters_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(3, 3), Scale())
    with pytest.raises(ConfigError, match=r"module '1' \(Scale\).*\['gain'\].*reset_parameters"):
        _setup(model)


class Dropped(nn.Module):
    """A reset_parameters that replaces its weight with None."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(2))

    def reset_parameters(self) -> None:
        self.weight = None  # type: ignore[assignment]


def test_a_reset_parameters_that_drops_its_tensor_is_named() -> None:
    with torch.device("meta"):
        model = nn.Sequential(Dropped())
    with pytest.raises(ConfigError, match=r"Dropped.reset_parameters\(\) left 'weight' as None"):
        _setup(model)


class Forgets(nn.Module):
    """A reset_parameters that initialises its weight and forgets its gain (or, ``half``,
    writes only half of it)."""

    def __init__(self, half: bool = False) -> None:
        super().__init__()
        self.half = half
        self.weight = nn.Parameter(torch.empty(4))
        self.gain = nn.Parameter(torch.empty(4))

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight)
        if self.half:
            nn.init.ones_(self.gain[:2])


@pytest.mark.parametrize("half", [False, True])
def test_a_tensor_that_reset_parameters_leaves_unwritten_is_named(half: bool) -> None:
    """It trained on uninitialised memory (a gain of 0 to 3e32 per rank's shard)."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Forgets(half))
    says = r"Forgets.reset_parameters\(\) left 'gain' \(of the meta-device model's module '1'\)"
    with pytest.raises(ConfigError, match=says + " uninitialised"):
        _setup(model)


def test_a_model_partly_on_the_meta_device_is_refused() -> None:
    model = nn.Sequential(nn.Linear(3, 3), blocks_model(depth=1))
    with pytest.raises(ConfigError, match=r"partly on the meta device \('1.0.weight' is"):
        _setup(model)


def test_a_meta_model_trains_through_the_handler() -> None:
    with NNHandler(blocks_model(), adam, nn.CrossEntropyLoss()) as h:
        h.train(blocks_data(), epochs=3)
        losses = [r["train_loss"] for r in h.history.records]
    assert losses[-1] < losses[0]


# ------------------------------------------------------------------ weights from a file
def _reference(tmp_path: Path) -> tuple[dict[str, torch.Tensor], Path]:
    torch.manual_seed(3)
    state = blocks_model(meta=False).state_dict()
    path = tmp_path / "weights.pt"
    torch.save(state, path)
    return state, path


def test_weights_load_from_a_state_dict_file_into_a_meta_model(tmp_path: Path) -> None:
    state, path = _reference(tmp_path)
    loaded = _setup(blocks_model(), init_weights=str(path)).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


def test_weights_load_from_a_checkpoint_file_and_with_wrapper_prefixes(tmp_path: Path) -> None:
    state, _ = _reference(tmp_path)
    prefixed = tmp_path / "ddp.pt"
    torch.save({"model": {f"module.{k}": v for k, v in state.items()}}, prefixed)
    loaded = _setup(blocks_model(meta=False), init_weights=str(prefixed)).state_dict()
    assert all(torch.equal(loaded[k], state[k]) for k in state)


class WithTable(nn.Module):
    """A layer with a buffer no state dict holds, computed by its reset_parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)
        self.register_buffer("table", torch.empty(3), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.table.copy_(torch.arange(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) + self.table


def test_buffers_a_file_cannot_give_are_initialised_before_loading(tmp_path: Path) -> None:
    torch.manual_seed(4)
    state = WithTable().state_dict()
    assert "table" not in state
    torch.save(state, tmp_path / "table.pt")
    with torch.device("meta"):
        model = WithTable()
    loaded = _setup(model, init_weights=str(tmp_path / "table.pt"))
    assert torch.equal(loaded.table, torch.arange(3.0))
    assert torch.equal(loaded.linear.weight, state["linear.weight"])


def test_weights_that_do_not_match_name_the_keys(tmp_path: Path) -> None:
    state, _ = _reference(tmp_path)
    del state["1.linear.bias"]
    path = tmp_path / "partial.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"missing \['1.linear.bias'\]"):
        _setup(blocks_model(), init_weights=str(path))
    torch.save({"lr": torch.tensor(0.1), "step": 3}, tmp_path / "other.pt")
    with pytest.raises(CheckpointError, match="holds no state dict"):
        _setup(blocks_model(), init_weights=str(tmp_path / "other.pt"))


def test_weights_of_another_shape_are_named(tmp_path: Path) -> None:
    state, _ = _reference(tmp_path)
    state["0.weight"] = torch.zeros(16, 7)
    path = tmp_path / "shape.pt"
    torch.save(state, path)
    with pytest.raises(CheckpointError, match=r"'0.weight' has shape \(16, 7\)"):
        _setup(blocks_model(), init_weights=str(path))


# ------------------------------------------------------------------ activation checkpointing
def _gradients(mode: str, compile_blocks: bool = False) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = blocks_model(depth=3, dropout=0.2, meta=False)
    options: dict[str, Any] = {"fsdp": {"blocks": ["Block"], "activation_checkpointing": mode}}
    if compile_blocks:
        options.update(compile="blocks", compile_kwargs={"backend": "aot_eager"})
    module = _setup(model, **options)
    x, y = blocks_data(n=8).tensors
    torch.manual_seed(1)  # the dropout masks
    nn.functional.cross_entropy(module(x), y).backward()
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


def test_checkpointed_blocks_give_the_same_gradients_and_keep_their_names() -> None:
    plain = _gradients("none")
    for mode in ("full", "selective"):
        recomputed = _gradients(mode)
        assert recomputed.keys() == plain.keys()  # the parameter names do not change
        for name, grad in plain.items():
            assert torch.equal(recomputed[name], grad), (mode, name)


def test_compiled_blocks_with_checkpointing_give_the_same_gradients() -> None:
    plain = _gradients("none")
    compiled = _gradients("full", compile_blocks=True)
    for name, grad in plain.items():
        torch.testing.assert_close(compiled[name], grad, rtol=1e-5, atol=1e-6)


def test_checkpointing_refuses_blocks_with_batchnorm_and_models_without_blocks() -> None:
    with pytest.raises(ConfigError, match=r"block Sequential holds BatchNorm1d.*twice"):
        model = nn.Sequential(nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3)))
        _setup(model, fsdp={"blocks": ["Sequential"], "activation_checkpointing": "full"})
    with pytest.raises(ConfigError, match=r"'full' recomputes each block, and the model has no"):
        _setup(nn.Linear(3, 3), fsdp={"activation_checkpointing": "full"})
    with pytest.raises(ConfigError, match=r"fsdp.blocks names \['Missing'\].*Block"):
        _setup(blocks_model(), fsdp={"blocks": ["Missing"], "activation_checkpointing": "full"})
    with pytest.raises(ConfigError, match="compile: 'blocks' compiles each block"):
        _setup(nn.Linear(3, 3), compile="blocks")


# ------------------------------------------------------------------ mesh sizes
def test_mesh_sizes() -> None:
    assert mesh_shape(8, 4, "auto", "auto") == (2, 4)  # shard in a machine, replicate across
    assert mesh_shape(8, 4, 1, "auto") == (1, 8)
    assert mesh_shape(8, 4, 4, "auto") == (4, 2)
    assert mesh_shape(8, 4, "auto", 2) == (4, 2)
    with pytest.raises(ConfigError, match=r"fsdp.replicate=3 x fsdp.shard=2 must equal .* 8"):
        mesh_shape(8, 4, 3, 2)
    with pytest.raises(ConfigError, match=r"fsdp.replicate=auto x fsdp.shard=3"):
        mesh_shape(8, 4, "auto", 3)
    with pytest.raises(ConfigError, match="each machine's 3 ranks"):
        mesh_shape(8, 3, "auto", "auto")
    with pytest.raises(ValueError, match="a mesh size is a number of ranks"):
        TrainerConfig(fsdp={"replicate": 0})


# ------------------------------------------------------------------ the memory plan
def test_optimizer_slots() -> None:
    params = [nn.Parameter(torch.zeros(2))]
    assert optimizer_slots([torch.optim.Adam(params)]) == (2.0, "Adam")
    assert optimizer_slots([torch.optim.AdamW(params, amsgrad=True)])[0] == 3.0
    assert optimizer_slots([torch.optim.SGD(params, lr=0.1)])[0] == 0.0
    assert optimizer_slots([torch.optim.SGD(params, lr=0.1, momentum=0.9)])[0] == 1.0
    assert optimizer_slots([torch.optim.LBFGS(params)]) == (2.0, "LBFGS (assumed 2 slots)")


SIZES = ModelSizes(
    parameters=400 * MiB,
    trainable=400 * MiB,
    buffers=0,
    largest_block=16 * MiB,
    outside_blocks=4 * MiB,
    largest_tensor=16 * MiB,
)


def test_the_plan_divides_the_training_state_by_the_shards() -> None:
    ddp = plan_memory(SIZES, Layout("ddp", replicate=4), 2.0, "Adam", None)
    fsdp = plan_memory(SIZES, Layout("fsdp", shard=4), 2.0, "Adam", None)
    hsdp = plan_memory(SIZES, Layout("fsdp", shard=2, replicate=2), 2.0, "Adam", None)
    sizes = {name: size for name, size, _ in fsdp.items}
    assert sizes["parameters"] == sizes["gradients"] == 100 * MiB
    assert sizes["optimizer state"] == 200 * MiB
    assert sizes["communication buffers"] == 2 * (16 + 16) * MiB + 2 * 4 * MiB
    assert ddp.total == (400 + 400 + 800 + 32 + 400) * MiB  # + workspace, buckets
    assert fsdp.total < hsdp.total < ddp.total


def test_gradients_and_activations_count_once_in_the_total() -> None:
    small = Activations(none=50 * MiB, full=10 * MiB, selective=20 * MiB)
    large = Activations(none=900 * MiB, full=10 * MiB, selective=20 * MiB)
    without = plan_memory(SIZES, Layout("fsdp", shard=4), 2.0, "Adam", None).total
    # Hidden under the gradients in training; validation holds both (+ full's 10 MiB).
    assert plan_memory(SIZES, Layout("fsdp", shard=4), 2.0, "Adam", small).total == (
        without + 10 * MiB
    )
    with_large = plan_memory(SIZES, Layout("fsdp", shard=4), 2.0, "Adam", large).total
    assert with_large == without + (900 - 100) * MiB


def test_the_evaluation_pass_is_counted_with_the_gradients_held() -> None:
    """Under FSDP2 with full activation checkpointing the validation pass measured 30% over
    a plan that left it out: the plan's total is now the larger of both peaks."""
    activations = Activations(none=900 * MiB, full=40 * MiB, selective=200 * MiB)
    layout = Layout("fsdp", shard=4, activation_checkpointing="full")
    without = plan_memory(SIZES, layout, 2.0, "Adam", None).total
    plan = plan_memory(SIZES, layout, 2.0, "Adam", activations)
    assert [name for name, _, _ in plan.items][-2:] == ["activations", "validation"]
    assert plan.total == without + 40 * MiB  # training alone: 40 MiB hidden under gradients
    alone = plan_memory(SIZES, layout, 2.0, "Adam", activations, validation=False)
    assert alone.total == without and "validation" not in [n for n, _, _ in alone.items]
    none = plan_memory(SIZES, Layout("fsdp", shard=4), 2.0, "Adam", activations)
    assert none.total == without + (900 - 100) * MiB  # training's peak is the larger there


def test_a_plan_over_the_budget_names_a_layout_that_fits() -> None:
    activations = Activations(none=900 * MiB, full=10 * MiB, selective=200 * MiB)
    layout = Layout("fsdp", shard=4)
    plan = plan_memory(SIZES, layout, 2.0, "Adam", activations)
    advice = fitting_layout(SIZES, layout, 2.0, "Adam", activations, 4, 500 * MiB)
    assert advice.startswith("fsdp.activation_checkpointing: full (")
    with pytest.raises(
        ConfigError,
        match=r"needs 1\.\d+ GiB per rank, more than the budget of "
        r"500\.0 MiB \(trainer.memory_budget\); the largest item is activations",
    ):
        check_budget(plan, 500 * MiB, advice, "trainer.memory_budget")
    ddp = Layout("ddp", replicate=4)
    advice = fitting_layout(SIZES, ddp, 2.0, "Adam", None, 4, 700 * MiB)
    assert advice.startswith("strategy: fsdp over all 4 ranks")
    advice = fitting_layout(SIZES, ddp, 2.0, "Adam", None, 4, 200 * MiB)
    assert advice.startswith("strategy: fsdp over at least 16 ranks")


def test_the_handler_refuses_a_model_over_its_budget_before_training() -> None:
    config = {"trainer": {"memory_budget": "36KiB"}}
    expected = (
        r"memory plan \(single over 1 rank\(s\)\) needs 42\.5 KiB per rank, more than the "
        r"budget of 36\.0 KiB .*What would fit: strategy: fsdp over at least 4 ranks \(30"
    )
    with pytest.raises(ConfigError, match=expected):
        NNHandler(blocks_model(depth=8), adam, nn.CrossEntropyLoss(), config=config)


def test_the_activations_are_checked_at_the_first_step() -> None:
    trainer = {"memory_budget": "80KiB", "fsdp": {"blocks": ["Block"]}}
    config = {"trainer": trainer, "loader": {"batch_size": 48}}
    model = blocks_model(depth=6, meta=True)
    with NNHandler(model, adam, nn.CrossEntropyLoss(), config=config) as h:  # fits without
        plan = h.trainer.memory.plan
        assert plan is not None and plan.total < 80 * 1024
        expected = r"the largest item is activations.*fsdp.activation_checkpointing: full"
        with pytest.raises(ConfigError, match=expected):
            h.train(blocks_data(n=96), epochs=1)
        assert h.trainer.state.global_step == 0  # refused before the first step


def test_the_activation_estimate_orders_the_modes() -> None:
    model = blocks_model(depth=4, meta=True)
    twin = meta_twin(model)
    assert twin is not None
    x = torch.randn(64, 6)
    estimate = estimate_activations(twin, [f"{i}" for i in range(1, 5)], x)
    assert estimate.none > estimate.selective > estimate.full > 0
    per_block_input = 64 * 16 * 4
    assert estimate.full >= 4 * per_block_input


class DataDependent(nn.Module):
    """A forward the meta device cannot run (it reads a value)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * (2.0 if x.sum().item() > 0 else 1.0)


def test_the_plan_is_printed_once_per_item_and_says_when_activations_are_unknown(
    lines: list[str],
) -> None:
    with torch.device("meta"):
        model = DataDependent()
    with NNHandler(model, adam, nn.CrossEntropyLoss(), config={"trainer": {"epochs": 1}}) as h:
        h.train(blocks_data(n=16), epochs=1)
    plan = [line for line in lines if line.startswith(("memory plan", "  "))]
    names = [line.split(":")[0].strip() for line in plan[1:]]
    assert plan[0] == "memory plan (single over 1 rank(s)), per rank:"
    assert names == [
        "parameters", "gradients", "optimizer state", "optimizer step workspace", "activations",
    ]  # fmt: skip
    assert "not estimated (the model's forward does not run on the meta device" in plan[-1]
    assert "total without them: " in plan[-1]
