"""The checkpoint formats of earlier releases still load.

Each set of tests/fixtures/ holds one epoch of resume_helpers' run written by the code of its
day (see tests/fixtures/make_legacy_checkpoints.py): ``legacy/`` at 24b4425, before the
checkpoint-protocol rewrite (single files, a sharded folder with its ``manifest.json``, and
both committed to a ``file://`` object store by their ``<name>.manifest.json``), ``routes/``
at 1b9fcdd, before the checkpoint-routes change (the same, and the background saves: a
sharded folder and an object store's single files). Each resumes bit-exact (the run ends
where the uninterrupted run does; on a CPU whose kernels give other last bits than the
fixtures' machine's, an AVX-512 one, within float tolerance), loads for inference, and a
changed byte in it is named, never loaded.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import NNHandler
from nn_handler.errors import CheckpointError
from tests import resume_helpers as rh
from tests.fixtures.make_legacy_checkpoints import FIXTURES, SETS, on_a_store, options_of
from tests.training_helpers import regression_data

NAME = "ckpt-e0001-s00000005"
#: Every fixture as (its set, its kind).
FIXTURE_KINDS = [(name, kind) for name, kinds in SETS.items() for kind in kinds]


def copy_of(fixture: str, kind: str, tmp_path: Path) -> tuple[str, dict[str, Any], Path]:
    """The fixture ``kind`` of the set ``fixture`` copied under ``tmp_path``: (checkpoint.dir,
    the other checkpoint options, the folder holding the checkpoints' bytes)."""
    shutil.copytree(FIXTURES / fixture / kind, tmp_path / kind)
    options: dict[str, Any] = options_of(kind)
    if on_a_store(kind):
        options["staging_dir"] = str(tmp_path / "fresh-machine")
        return f"file://{tmp_path / kind}/run", options, tmp_path / kind / "run"
    return str(tmp_path / kind), options, tmp_path / kind


def checkpoint_path(kind: str, where: str) -> str:
    return f"{where}/{NAME}" if kind.endswith("sharded") else f"{where}/{NAME}.pt"


def handler(where: str, **options: Any) -> NNHandler:
    return NNHandler(
        rh.model(),
        rh.adam,
        nn.CrossEntropyLoss(),
        rh.step_lr,
        config=rh.config(where, 1, False, **options),  # type: ignore[arg-type]
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    with rh.handler(tmp_path_factory.mktemp("plain"), 1, False, None) as h:
        h.train(regression_data(), regression_data(n=16, seed=1), epochs=rh.EPOCHS)
        return rh.outcome(h)


@pytest.fixture(scope="module")
def first_epoch(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    with rh.handler(tmp_path_factory.mktemp("first-epoch"), 1, False, None) as h:
        h.train(regression_data(), regression_data(n=16, seed=1), epochs=1)
        return dict(h.model.state_dict())


def computes_like(fixture: str, first_epoch: dict[str, torch.Tensor]) -> bool:
    """Whether this CPU's kernels give the bits of the machine that wrote the set
    ``fixture``: the run's first epoch here ends with exactly the weights of its ``file``
    fixture (written at its step 5). An AVX-512 machine's float sums differ from an AVX2
    one's in the last bits (3e-8 after an epoch): there a fixture's continuation cannot
    match this machine's uninterrupted run bit for bit, whatever the loader does
    (docs/checkpoints.md)."""
    where = str(FIXTURES / fixture / "file")
    saved = NNHandler.load(checkpoint_path("file", where), rh.model()).model
    return all(torch.equal(first_epoch[k], v) for k, v in saved.state_dict().items())


@pytest.mark.parametrize("fixture", sorted(SETS))
def test_the_fixtures_are_the_bytes_the_old_code_wrote(fixture: str) -> None:
    """SHA-256 of every fixture file as committed (``legacy`` in d1ebdac, written by
    24b4425's code; ``routes`` by 1b9fcdd's), in ``sha256sum`` format: a regenerated
    fixture, which would test nothing, fails here instead of passing silently."""
    here = FIXTURES / fixture
    pinned = {}
    for line in (FIXTURES / f"{fixture}.sha256").read_text().splitlines():
        digest, name = line.split("  ", 1)
        pinned[name] = digest
    found = {p.relative_to(here).as_posix(): p for p in here.rglob("*") if p.is_file()}
    assert sorted(found) == sorted(pinned)
    for name, path in found.items():
        assert hashlib.sha256(path.read_bytes()).hexdigest() == pinned[name], name


@pytest.mark.parametrize("fixture", sorted(SETS))
def test_the_fixtures_are_their_formats(fixture: str) -> None:
    here = FIXTURES / fixture
    found = {p.relative_to(here).as_posix() for p in here.rglob("*") if p.is_file()}
    assert f"file/{NAME}.pt" in found
    assert f"sharded/{NAME}/manifest.json" in found
    assert f"store/run/{NAME}.pt.manifest.json" in found
    assert f"store_sharded/run/{NAME}.manifest.json" in found
    assert f"store_sharded/run/{NAME}/__0_0.distcp" in found
    if fixture != "legacy":
        assert f"async_sharded/{NAME}/manifest.json" in found
        assert f"async_store/run/{NAME}.pt.manifest.json" in found
    assert sorted(p.name for p in here.iterdir() if p.is_dir()) == sorted(SETS[fixture])


@pytest.mark.parametrize(("fixture", "kind"), FIXTURE_KINDS)
def test_a_legacy_checkpoint_resumes_bit_exact(
    fixture: str,
    kind: str,
    tmp_path: Path,
    uninterrupted: dict[str, Any],
    first_epoch: dict[str, torch.Tensor],
) -> None:
    """Resumed, a legacy checkpoint ends where the uninterrupted run does: bit for bit on a
    CPU that computes as the fixtures' machine did (this project's machines, CI); on another
    kind (AVX-512) every count, step and position exactly and each float within 1e-5 (a
    lost RNG state or data position would miss by far more: the order of the samples)."""
    where, options, _ = copy_of(fixture, kind, tmp_path)
    with handler(where, resume="auto", **options) as h:
        h.train(regression_data(), regression_data(n=16, seed=1), epochs=rh.EPOCHS)
        resumed = rh.outcome(h)
    if computes_like(fixture, first_epoch):
        assert rh.same(resumed, uninterrupted), kind
    else:
        assert close(resumed, uninterrupted), kind


def close(a: Any, b: Any) -> bool:
    """``rh.same`` with floats (and float tensors) within 1e-5, everything else exact."""
    if isinstance(a, torch.Tensor):
        if not (isinstance(b, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype):
            return False
        return bool(
            torch.allclose(a, b, rtol=1e-5, atol=1e-5)
            if a.is_floating_point()
            else torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(close(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(close(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, float) and isinstance(b, float):
        return abs(a - b) <= 1e-5 * max(1.0, abs(b)) or (a != a and b != b)
    return bool(a == b)


def test_the_tolerant_comparison_still_tells_a_different_run() -> None:
    """``close`` is not vacuous: an uninterrupted run of another data order fails it, a
    change in the last bits passes it, and a step count must be exact."""
    base = {"w": torch.tensor([1.0, 2.0]), "step": 5, "loss": 0.5}
    assert close({**base, "w": torch.tensor([1.0 + 3e-8, 2.0])}, base)
    assert not close({**base, "w": torch.tensor([1.01, 2.0])}, base)
    assert not close({**base, "step": 6}, base)
    assert not close({**base, "loss": 0.51}, base)


@pytest.mark.parametrize(("fixture", "kind"), FIXTURE_KINDS)
def test_a_legacy_checkpoint_loads_for_inference(
    fixture: str,
    kind: str,
    tmp_path: Path,
    uninterrupted: dict[str, Any],
    first_epoch: dict[str, torch.Tensor],
) -> None:
    where, _, _ = copy_of(fixture, kind, tmp_path)
    loaded = NNHandler.load(checkpoint_path(kind, where), rh.model())
    assert loaded.trainer.state.global_step == 5
    first = loaded.history.records[0]["train_loss"]
    if computes_like(fixture, first_epoch):
        assert first == uninterrupted["history"][0]["train_loss"]
    else:
        assert close(first, uninterrupted["history"][0]["train_loss"])
    # An epoch later than the fixture's, so the weights differ from the uninterrupted end.
    assert not torch.equal(loaded.model[0].weight, uninterrupted["model"]["0.weight"])


def flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("fixture", "kind"), FIXTURE_KINDS)
def test_a_changed_byte_in_a_legacy_checkpoint_is_named(
    fixture: str, kind: str, tmp_path: Path
) -> None:
    damaged = f"{NAME}/__0_0.distcp" if kind.endswith("sharded") else f"{NAME}.pt"
    where, _, stored = copy_of(fixture, kind, tmp_path)
    flip_a_byte(stored / damaged)
    with pytest.raises(CheckpointError, match=r"corrupt|changed|has CRC-32|does not match") as e:
        NNHandler.load(checkpoint_path(kind, where), rh.model())
    assert Path(damaged).name in str(e.value)
