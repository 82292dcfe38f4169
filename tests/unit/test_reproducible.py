"""The reproducible mode in one process: what it refuses before the first step (each error
names the culprit and the way out), how it treats BatchNorm, buffers and non-finite steps,
and that it trains like the normal mode (the same gradient up to the fixed-point rounding)."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from nn_handler import ConfigError, NNHandler, Trainer, TrainerConfig
from nn_handler.data.fixed_batches import FixedBatchLoader
from nn_handler.distributed.communicator import NullCommunicator
from nn_handler.training.reproducible import exact_step
from nn_handler.training.reproducible.mode import ReproducibleMode
from tests.conftest import cuda_only
from tests.reproducible_helpers import StepCounter, cnn, images

MODE = {"global_batch_size": 16, "micro_batch_size": 4}


def _handler(model: nn.Module | None = None, **trainer: Any) -> NNHandler:
    config = {
        "loader": {"batch_size": 8, "seed": 3},
        "trainer": {"progress_bar": False, "reproducible": MODE, **trainer},
    }
    return NNHandler(
        model if model is not None else cnn(),
        lambda p: torch.optim.Adam(p, lr=3e-3),
        nn.CrossEntropyLoss(),
        config=config,
    )


@pytest.mark.parametrize(
    ("settings", "says"),
    [
        ({"reproducible": {"global_batch_size": 10, "micro_batch_size": 4}}, "not a multiple"),
        ({"accumulate_grad_batches": 2}, "accumulate_grad_batches: the mode cuts"),
        (
            {"strategy": "fsdp", "reproducible": {**MODE, "reduction": "float"}},
            "reduction: 'float' with strategy 'fsdp' is FSDP2's own",
        ),
        (
            {"strategy": "fsdp", "fault_tolerance": {"lighthouse": "http://127.0.0.1:1"}},
            "fault_tolerance: a member that joins receives the whole state",
        ),
        ({"strategy": "single"}, "strategy 'single' is not supported"),
        ({"sync_batchnorm": True}, "sync_batchnorm: SyncBatchNorm averages"),
        ({"limit_val_batches": 2}, "limit_val_batches: it limits each rank's share"),
    ],
)
def test_configs_it_cannot_keep_identical_are_config_errors(
    settings: dict[str, Any], says: str
) -> None:
    with pytest.raises(ConfigError, match=says):
        TrainerConfig.model_validate({"reproducible": MODE, **settings})


@pytest.mark.parametrize(
    ("layer", "says"),
    [
        (nn.SyncBatchNorm(4), r"layer '1' is a SyncBatchNorm"),
        (nn.InstanceNorm2d(4, track_running_stats=True), r"layer '1' \(InstanceNorm2d\) keeps"),
    ],
)
def test_layers_it_cannot_keep_identical_are_named(layer: nn.Module, says: str) -> None:
    model = nn.Sequential(nn.Conv2d(1, 4, 3), layer, nn.Flatten(), nn.Linear(144, 3))
    with pytest.raises(ConfigError, match=says):
        _handler(model)


def test_fp16_with_a_dynamic_scaler_is_refused() -> None:
    precision: Any = SimpleNamespace(scaler=object())
    config = TrainerConfig.model_validate({"reproducible": MODE}).reproducible
    assert config is not None
    with pytest.raises(ConfigError, match=r"fp16 with a dynamic GradScaler .* 'bf16' or '32'"):
        ReproducibleMode(config, cnn(), NullCommunicator(), torch.device("cpu"), precision)


def test_cuda_without_deterministic_algorithms_is_refused() -> None:
    precision: Any = SimpleNamespace(scaler=None)
    config = TrainerConfig.model_validate({"reproducible": MODE}).reproducible
    assert config is not None and not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(ConfigError, match=r"use_deterministic_algorithms\(True\)"):
        ReproducibleMode(config, cnn(), NullCommunicator(), torch.device("cuda"), precision)


def test_manual_optimization_and_stateful_metrics_are_refused() -> None:
    class Manual(Trainer):
        automatic_optimization = False

    config = TrainerConfig(progress_bar=False, reproducible=MODE)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="manual optimization"):
        Manual(cnn(), lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(), config=config)

    class Counter:  # a torchmetrics-style metric: it keeps state and syncs it itself
        def update(self, *args: Any) -> None: ...
        def compute(self) -> float:
            return 0.0

        def reset(self) -> None: ...

    with pytest.raises(ConfigError, match=r"metrics \['count'\] keep their own state"):
        Trainer(cnn(), lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(),
                config=config, metrics={"count": Counter()})  # fmt: skip


def test_a_loader_of_ones_own_is_refused_before_the_first_step() -> None:
    with _handler() as h:
        before = [p.detach().clone() for p in h.model.parameters()]
        with pytest.raises(ConfigError, match="training loader is a DataLoader, whose batches"):
            h.train(DataLoader(images(32, 0), batch_size=8), epochs=1)
        good = h.loaders.reproducible_train_loader(images(32, 0), h.config.trainer.reproducible)  # type: ignore[arg-type]
        with pytest.raises(ConfigError, match="validation loader is a DataLoader"):
            h.trainer.fit(good, DataLoader(images(8, 1), batch_size=8), epochs=1)
        assert all(torch.equal(a, b) for a, b in zip(before, h.model.parameters(), strict=True))


def test_a_rank_cached_loader_is_refused() -> None:
    config = {
        "loader": {"batch_size": 8, "mode": "rank_cached"},
        "trainer": {"progress_bar": False, "reproducible": MODE},
    }
    handler = NNHandler(cnn(), lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(),
                        config=config)  # fmt: skip
    with handler as h, pytest.raises(ConfigError, match="loader mode 'rank_cached' gives each"):
        h.train(images(32, 0), epochs=1)


class _Twice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6)
        self.head = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.norm(x.flatten(1)[:, :6])))


@pytest.mark.parametrize(
    ("model", "says"),
    [
        (
            nn.Sequential(StepCounter(), cnn()),
            r"the buffer '0\.seen' changed in a training forward",
        ),
        (_Twice(), r"BatchNorm layer 'norm' ran 2 times in one forward"),
    ],
)
def test_a_forward_it_cannot_keep_identical_fails_the_first_step(
    model: nn.Module, says: str
) -> None:
    with _handler(model) as h, pytest.raises(ConfigError, match=says):
        h.train(images(32, 0), epochs=1)


def test_a_training_step_that_returns_more_than_the_loss_is_refused() -> None:
    class Extras(Trainer):
        def training_step(self, batch: Any) -> dict[str, torch.Tensor]:
            loss = super().training_step(batch)
            assert isinstance(loss, torch.Tensor)
            return {"loss": loss, "twice": 2 * loss.detach()}

    config = TrainerConfig(progress_bar=False, reproducible=MODE)  # type: ignore[arg-type]
    trainer = Extras(cnn(), lambda p: torch.optim.SGD(p, lr=0.1), nn.CrossEntropyLoss(),
                     config=config)  # fmt: skip
    loader = FixedBatchLoader(images(32, 0), global_batch_size=16, micro_batch_size=4, seed=0,
                              shuffle=False, drop_last=False, rank=0, world_size=1)  # fmt: skip
    with pytest.raises(ConfigError, match=r"training_step returned \['twice'\] besides the loss"):
        trainer.fit(loader, epochs=1)


def test_batchnorm_statistics_are_those_of_the_whole_global_batch() -> None:
    """Each micro-batch normalises with its own statistics; the running ones move once per
    step, by the statistics of the whole global batch (as one forward over it would)."""
    torch.manual_seed(0)
    data = images(16, 0)
    with _handler(nn.Sequential(nn.BatchNorm2d(1), nn.Flatten(), nn.Linear(64, 3))) as h:
        h.train(data, epochs=1)  # one step of 16 samples in 4 micro-batches
        norm = h.model[0]
        x = data.tensors[0]
        assert int(norm.num_batches_tracked) == 1
        expected_mean = 0.9 * 0 + 0.1 * x.mean(dtype=torch.float64)
        expected_var = 0.9 * 1 + 0.1 * x.double().var(unbiased=True)
        assert math.isclose(float(norm.running_mean), float(expected_mean), rel_tol=1e-6)
        assert math.isclose(float(norm.running_var), float(expected_var), rel_tol=1e-6)


def test_a_non_finite_loss_skips_the_step_on_every_rank_alike() -> None:
    class Poisoned(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = cnn()
            self.calls = 0

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            out: torch.Tensor = self.inner(x)
            return out * math.nan if self.calls == 2 else out  # the 2nd micro-batch

    with _handler(Poisoned()) as h:
        before = {k: v.clone() for k, v in h.model.state_dict().items()}
        h.train(images(16, 0), epochs=1)
        assert h.trainer.state.skipped_steps == 1
        after = h.model.state_dict()
        assert all(torch.equal(before[k], after[k]) for k in before)  # weights and BN stats


def test_it_trains_like_the_normal_mode() -> None:
    """With one micro-batch per step and no dropout, the mode's gradient is the normal
    mode's up to the fixed-point rounding: after 12 Adam steps the weights agree to float32
    rounding noise."""

    def model() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
                             nn.Linear(144, 3))  # fmt: skip

    runs = []
    for mode in (None, {"global_batch_size": 16, "micro_batch_size": 16}):
        config = {"loader": {"batch_size": 16, "seed": 3, "shuffle": False},
                  "trainer": {"progress_bar": False, "reproducible": mode}}  # fmt: skip
        with NNHandler(model(), lambda p: torch.optim.Adam(p, lr=3e-3), nn.CrossEntropyLoss(),
                       config=config) as h:  # fmt: skip
            h.train(images(96, 0), epochs=2)
            runs.append({k: v.clone() for k, v in h.model.state_dict().items()})
    normal, exact = runs
    for key in normal:
        if normal[key].is_floating_point():
            assert torch.allclose(normal[key], exact[key], rtol=1e-4, atol=1e-5), key


def test_the_modes_loaders_and_means_name_what_they_cannot_do() -> None:
    from torch.utils.data import IterableDataset

    from nn_handler.data.fixed_batches import FixedEvalLoader
    from nn_handler.training.reproducible.exact_means import ExactMeans

    kw: dict[str, Any] = {"seed": 0, "shuffle": False, "rank": 0, "world_size": 1}
    with pytest.raises(ConfigError, match="fewer than global_batch_size=16 with drop_last"):
        FixedBatchLoader(images(10, 0), global_batch_size=16, micro_batch_size=4,
                         drop_last=True, **kw)  # fmt: skip

    class Stream(IterableDataset[Any]):
        def __iter__(self) -> Any:
            return iter([])

    with pytest.raises(ConfigError, match="needs a map-style dataset with __len__"):
        FixedEvalLoader(Stream(), batch_size=4, rank=0, world_size=1)
    loader = FixedBatchLoader(images(32, 0), global_batch_size=16, micro_batch_size=4,
                              drop_last=False, **kw)  # fmt: skip
    with pytest.raises(ConfigError, match="cannot start at step 3: an epoch of this loader has 2"):
        loader.start_at(3)
    means = ExactMeans([0], total_batches=2)
    means.update({"loss": torch.tensor(1.0)}, 4)
    with pytest.raises(ConfigError, match="gave more than its 1 batches"):
        means.update({"loss": torch.tensor(1.0)}, 4)
    shaped = ExactMeans([0], total_batches=1)
    shaped.update({"scores": torch.ones(3)}, 4)
    with pytest.raises(ConfigError, match=r"'scores' has shape \(3,\); return per-batch means"):
        shaped.fold()


def test_the_step_refuses_what_it_cannot_reduce() -> None:
    config = TrainerConfig.model_validate({"reproducible": MODE}).reproducible
    assert config is not None
    precision: Any = SimpleNamespace(scaler=None)
    mode = ReproducibleMode(config, cnn(), NullCommunicator(), torch.device("cpu"), precision)
    with pytest.raises(ConfigError, match="floating-point parameters only"):
        mode.exact.adopt([nn.Parameter(torch.zeros(2, dtype=torch.int64), requires_grad=False)])
    with pytest.raises(ConfigError, match="a training batch is a tuple, not a StepBatch"):
        mode.step((torch.zeros(2, 1, 8, 8), torch.zeros(2)), lambda b: torch.zeros(()), 0)


def test_evaluate_and_predict_run_on_the_fixed_evaluation_batches() -> None:
    data = images(20, 1)
    with _handler() as h:
        h.train(images(32, 0), epochs=1)
        metrics = h.evaluate(data)
        outputs = h.predict(data)
        h.model.eval()
        with torch.no_grad():
            expected = h.model(data.tensors[0])
        loss = float(nn.functional.cross_entropy(expected, data.tensors[1]))
    assert outputs.shape == (20, 3) and torch.allclose(outputs, expected, atol=1e-6)
    # The loaders' line states the step's sizes (not batch_size x world size).
    assert {"global_batch_size": 16, "micro_batch_size": 4, "evaluation_batch_size": 8}.items() <= (
        h.loaders.settings.items()
    )
    assert "effective_batch_size" not in h.loaders.settings
    assert math.isclose(metrics["loss"], loss, rel_tol=1e-5)  # batches of 8, 8 and 4


def test_a_factory_builds_the_modes_loaders_again_on_any_rank() -> None:
    """Every fit builds its loader: the second build on a rank that logs nothing (rank 1) once
    failed on the settings the first build had rewritten."""
    from nn_handler.config import LoaderConfig, ReproducibleConfig
    from nn_handler.data import LoaderFactory
    from nn_handler.distributed.env import DistributedInfo

    mode = ReproducibleConfig(**MODE)  # type: ignore[arg-type]
    for rank in (0, 1):
        factory = LoaderFactory(LoaderConfig(batch_size=8), DistributedInfo(rank, rank, 2, 2),
                                torch.device("cpu"))  # fmt: skip
        loaders = [factory.reproducible_train_loader(images(32, 0), mode) for _ in range(2)]
        assert [len(loader) for loader in loaders] == [2, 2]
        assert factory.settings["global_batch_size"] == 16
        assert factory.settings["evaluation_batch_size"] == 8


def _altered(tmp_path: Any, change: Any) -> tuple[Any, Any]:
    """A reproducible run's checkpoint, rewritten by ``change(checkpoint)`` (a valid file:
    only its values differ)."""
    from nn_handler import CheckpointError

    path = tmp_path / "ckpt.pt"
    with _handler(cnn()) as h:
        h.train(images(32, 0), epochs=1)
        h.save(path)
    saved = torch.load(path, weights_only=True)
    change(saved)
    torch.save(saved, path)
    with _handler(cnn()) as h, pytest.raises(CheckpointError) as error:
        h.resume(path)
    return error.value, saved


def test_fixed_point_exponents_of_another_dtype_are_refused_by_name(tmp_path: Any) -> None:
    def to_float(saved: dict[str, Any]) -> None:
        saved["reproducible"]["exponents"] = saved["reproducible"]["exponents"].float()

    error, _ = _altered(tmp_path, to_float)
    assert "the 'reproducible' state of" in str(error)
    assert "fixed-point exponents are float32 of shape" in str(error)
    assert "this run needs int64" in str(error)


def test_a_restored_tensor_of_another_dtype_or_shape_is_refused_by_name(tmp_path: Any) -> None:
    def widen(saved: dict[str, Any]) -> None:
        model = saved["model"]
        key = next(iter(model))
        model[key] = model[key].double()

    error, saved = _altered(tmp_path, widen)
    key = next(iter(saved["model"]))
    assert "the 'model' state of" in str(error) and f"[{key!r}] is float64 of shape" in str(error)
    assert "float32 of shape" in str(error) and "in this run" in str(error)


@pytest.mark.parametrize(
    ("changed", "says"),
    [
        ({"global_batch_size": 32}, "global_batch_size: 16 in the checkpoint, 32 in this run"),
        ({"global_batch_size": 8}, "global_batch_size: 16 in the checkpoint, 8 in this run"),
        ({"micro_batch_size": 2}, "micro_batch_size: 4 in the checkpoint, 2 in this run"),
        ({"seed": 7}, "seed: 0 in the checkpoint, 7 in this run"),
    ],
)
def test_a_resume_with_other_reproducible_settings_is_refused_by_field(
    tmp_path: Any, changed: dict[str, int], says: str
) -> None:
    """Another global batch size re-cut the epoch (32 -> 64: half its samples never trained;
    32 -> 16: some trained twice) under a 'bit-identical' promise; now a ConfigError names
    the field, explicit resume or not, and the fingerprint holds the settings."""
    from nn_handler.checkpoint.run_identity import IDENTITY

    path = tmp_path / "ckpt.pt"
    with _handler(cnn()) as h:
        h.train(images(64, 0), epochs=1)
        h.save(path)
    other = {"global_batch_size": 16, "micro_batch_size": 4, **changed}
    config = {
        "loader": {"batch_size": 8, "seed": 3},
        "trainer": {"progress_bar": False, "reproducible": other},
    }
    with NNHandler(cnn(), lambda p: torch.optim.Adam(p, lr=3e-3), nn.CrossEntropyLoss(),
                   config=config) as h, pytest.raises(ConfigError) as error:  # fmt: skip
        h.resume(path)
    assert "cannot resume" in str(error.value) and f"trainer.reproducible.{says}" in str(
        error.value
    )
    assert "skipped or trained twice" in str(error.value)
    assert {f"trainer.reproducible.{k}" for k in ("global_batch_size", "seed")} <= set(IDENTITY)


def test_a_checkpoint_of_the_mode_off_or_other_settings_is_refused_with_force_too(
    tmp_path: Any,
) -> None:
    """docs/reproducible.md: a checkpoint written with the mode off, or with other mode
    settings, is refused naming the field, "explicit resume or `force` alike"; and the mode
    off does not continue one written with it on. The refusal comes before any step: the
    folder keeps its checkpoint."""
    normal = {"loader": {"batch_size": 8, "seed": 3}, "trainer": {"progress_bar": False}}
    off = tmp_path / "off"
    with NNHandler(cnn(), lambda p: torch.optim.Adam(p, lr=3e-3), nn.CrossEntropyLoss(),
                   config={**normal, "checkpoint": {"dir": str(off)}}) as h:  # fmt: skip
        h.train(images(64, 0), epochs=1)
    (written,) = off.glob("ckpt-*.pt")
    with _handler() as h, pytest.raises(ConfigError) as error:
        h.resume(written)
    assert "it was written without trainer.reproducible, this run has it on" in str(error.value)
    for resume in ("force", "auto"):  # checkpoint.resume: force takes any run's otherwise
        forced = {"dir": str(off), "resume": resume}
        with (
            pytest.raises(ConfigError, match=r"written without trainer\.reproducible") as e,
            _handler_with(checkpoint=forced) as h,
        ):
            h.train(images(64, 0), epochs=2)
        assert "in the reproducible mode" in str(e.value), resume
    assert list(off.glob("ckpt-*.pt")) == [written]
    on = tmp_path / "on"
    with _handler_with(checkpoint={"dir": str(on)}) as h:
        h.train(images(64, 0), epochs=1)
    (written_on,) = on.glob("ckpt-*.pt")
    other_seed = {**MODE, "seed": 7}
    forced = {"dir": str(on), "resume": "force"}
    with (
        pytest.raises(ConfigError, match="seed: 0 in the checkpoint, 7 in this run"),
        _handler_with(reproducible=other_seed, checkpoint=forced) as h,
    ):
        h.train(images(64, 0), epochs=2)
    with NNHandler(cnn(), lambda p: torch.optim.Adam(p, lr=3e-3), nn.CrossEntropyLoss(),
                   config=normal) as h, pytest.raises(ConfigError) as error:  # fmt: skip
        h.resume(written_on)
    assert "it was written with trainer.reproducible, this run has it off" in str(error.value)
    assert list(on.glob("ckpt-*.pt")) == [written_on]


def _handler_with(
    reproducible: dict[str, Any] | None = None, checkpoint: dict[str, Any] | None = None
) -> NNHandler:
    """``_handler`` with another mode's settings and a checkpoint section."""
    config = {
        "loader": {"batch_size": 8, "seed": 3},
        "trainer": {"progress_bar": False, "reproducible": reproducible or MODE},
        **({"checkpoint": checkpoint} if checkpoint else {}),
    }
    return NNHandler(cnn(), lambda p: torch.optim.Adam(p, lr=3e-3), nn.CrossEntropyLoss(),
                     config=config)  # fmt: skip


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, cuda_only])]
)
def test_a_micro_batch_draws_from_its_seeded_streams_and_leaves_the_others(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Inside: the streams torch.manual_seed(seed) gives (CPU, and the GPU's on a CUDA
    device); outside: the streams as they were. No other device is seeded (nor, on a CPU,
    is a stack trace formatted to queue a lazy CUDA seeding: a cost per micro-batch)."""
    where = torch.device(device)

    def draws() -> torch.Tensor:
        return torch.cat([torch.rand(4), torch.rand(4, device=where).cpu()])

    torch.manual_seed(11)
    expected_inside = draws()
    torch.manual_seed(5)
    expected_after = draws()
    torch.manual_seed(5)
    if device == "cpu":
        monkeypatch.setattr(
            "traceback.format_stack", lambda *a, **k: pytest.fail("another device was seeded")
        )
    with exact_step._seeded(where, 11):
        inside = draws()
    assert torch.equal(inside, expected_inside)
    assert torch.equal(draws(), expected_after)


def test_an_int64_accumulator_takes_a_float64_sum_chunk_by_chunk_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """fixed_point.add_as_int64 (the exact step's accumulation without a whole int64 copy):
    the same integers as one conversion, across chunk boundaries and a short last chunk."""
    from nn_handler.training.reproducible import fixed_point

    monkeypatch.setattr(fixed_point, "CHUNK", 7)
    generator = torch.Generator().manual_seed(3)
    values = torch.randint(-(2**52), 2**52, (50,), generator=generator, dtype=torch.int64)
    start = torch.randint(-(2**40), 2**40, (50,), generator=generator, dtype=torch.int64)
    accumulator = start.clone()
    fixed_point.add_as_int64(accumulator, values.to(torch.float64))
    assert torch.equal(accumulator, start + values)


def test_a_micro_batchs_gradients_are_freed_before_the_next_ones_backward() -> None:
    """A step's peak holds one micro-batch's gradients at a time (the memory plan's
    "micro-batch gradients"): those of the micro-batch before are gone (accumulated) by the
    next one's forward. Until 2026-11-29 a local list kept them through it, 2T more at the
    peak than planned (benchmarks/memory_plan.py measured plan / peak 0.74)."""
    import weakref

    made: list[weakref.ref[torch.Tensor]] = []
    alive_at_forward: list[int] = []

    class Recording(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
            for p in self.inner.parameters():
                p.register_post_accumulate_grad_hook(lambda p: made.append(weakref.ref(p.grad)))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            alive_at_forward.append(sum(ref() is not None for ref in made))
            made.clear()
            return self.inner(x)

    with _handler(Recording()) as h:
        h.train(images(32, 0), epochs=1)  # two steps of 4 micro-batches
    assert len(alive_at_forward) >= 8 and alive_at_forward[0] == 0
    assert alive_at_forward[1:] == [0] * (len(alive_at_forward) - 1), alive_at_forward
