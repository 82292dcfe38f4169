"""Checkpoint files: atomic writes that survive SIGKILL, weights-only loading with clear errors,
prefix-tolerant weights, the CheckpointManager's rotation, pointer and fallback."""

from __future__ import annotations

import os
import pickle
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from nn_handler import CheckpointConfig, CheckpointError, ConfigError, HandlerConfig
from nn_handler.checkpoint import (
    CheckpointManager,
    Opened,
    atomic_save,
    capture_rng,
    load_file,
    load_model_state,
    open_checkpoint,
    remove_orphans,
    restart_count,
    restore_rng,
    strip_wrapper_prefixes,
)
from nn_handler.checkpoint.io import unsafe_entries
from nn_handler.checkpoint.naming import periodic_name
from nn_handler.checkpoint.single_file import FileWriter
from nn_handler.checkpoint.store import LATEST
from nn_handler.checkpoint.store.lease import LOCK
from nn_handler.checkpoint.verify import verify_records
from nn_handler.distributed.communicator import NullCommunicator
from tests.interpreters import python_path
from tests.tamper import record_spans

ROOT = Path(__file__).resolve().parents[2]


class Custom:
    """A class weights-only loading does not know."""

    def __init__(self) -> None:
        self.value = 3


def _manager(folder: Path, **config: object) -> CheckpointManager:
    return CheckpointManager(CheckpointConfig(dir=str(folder), **config), NullCommunicator())


# ----------------------------------------------------------------- atomic writes
def test_atomic_save_round_trips_and_leaves_no_temporary_file(tmp_path: Path) -> None:
    target = atomic_save({"w": torch.arange(4.0)}, tmp_path / "a.pt")
    assert torch.equal(load_file(target)["w"], torch.arange(4.0))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.pt"]


KILLED_WRITER = """
import sys, torch
from nn_handler.checkpoint import atomic_save
target = sys.argv[1]
version = 0
while True:
    version += 1
    atomic_save({"version": version, "w": torch.full((64, 1024, 64), float(version))}, target)
    print(version, flush=True)
"""


def test_sigkill_during_saves_leaves_a_complete_checkpoint(tmp_path: Path) -> None:
    """A writer saving 16 MiB checkpoints in a loop is SIGKILLed at an arbitrary moment: the
    target is always one complete version, and the next start removes the orphan."""
    target = tmp_path / "ckpt.pt"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": python_path(ROOT)}
    writer = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(target)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert writer.stdout is not None
        deadline = time.monotonic() + 60
        versions = 0
        while versions < 3 and time.monotonic() < deadline:
            if writer.stdout.readline():
                versions += 1
        assert versions == 3, "the writer did not start saving"
        time.sleep(0.013)  # somewhere inside a later save
    finally:
        writer.send_signal(signal.SIGKILL)
        writer.wait(timeout=30)
    assert writer.returncode == -signal.SIGKILL
    loaded = load_file(target)
    assert loaded["version"] >= 3
    assert torch.all(loaded["w"] == float(loaded["version"]))
    manager = _manager(tmp_path)  # a new run's manager cleans up whatever the killed save left
    assert sorted(p.name for p in tmp_path.iterdir()) == [LOCK, "ckpt.pt"]  # and holds it
    manager.release()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]


def test_remove_orphans_removes_only_temporary_files(tmp_path: Path) -> None:
    (tmp_path / ".ckpt.pt.tmp-123").write_bytes(b"partial")
    (tmp_path / "keep.pt").write_bytes(b"x")
    removed = remove_orphans(tmp_path)
    assert [p.name for p in removed] == [".ckpt.pt.tmp-123"]
    assert [p.name for p in tmp_path.iterdir()] == ["keep.pt"]


def test_a_failed_write_raises_checkpoint_error_and_keeps_the_old_file(tmp_path: Path) -> None:
    target = atomic_save({"v": 1}, tmp_path / "a.pt")
    with pytest.raises(Exception, match=r"can't pickle|Can't pickle|cannot pickle"):
        atomic_save({"v": 2, "bad": lambda: 0}, target)
    assert load_file(target)["v"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["a.pt"]


# ----------------------------------------------------------------- safe loading
@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b"", "0 bytes"),
        (b"this is not a checkpoint", "24 bytes"),
        (pickle.dumps({"a": 1}), "bytes"),
    ],
    ids=["empty", "text", "foreign-pickle"],
)
def test_unreadable_files_name_the_path_size_and_cause(
    tmp_path: Path, content: bytes, needle: str
) -> None:
    path = tmp_path / "bad.pt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    message = str(info.value)
    assert str(path) in message and needle in message
    if not content:
        assert "empty" in message


def test_truncated_checkpoint_is_a_checkpoint_error(tmp_path: Path) -> None:
    path = atomic_save({"w": torch.randn(1000)}, tmp_path / "t.pt")
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match=r"truncated, corrupt|t\.pt"):
        load_file(path)


def test_missing_file_is_a_checkpoint_error(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="no checkpoint file"):
        load_file(tmp_path / "nope.pt")


def test_arbitrary_objects_are_refused_with_how_to_allow_them(tmp_path: Path) -> None:
    path = tmp_path / "obj.pt"
    torch.save({"thing": Custom()}, path)
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    message = str(info.value)
    assert "Custom" in message and "add_safe_globals" in message and "trusted=" in message
    assert load_file(path, trusted=[Custom])["thing"].value == 3


class RunsACommand:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("echo this must never run",))


def test_a_code_running_global_is_named_and_never_offered_for_the_allowlist(
    tmp_path: Path,
) -> None:
    path = tmp_path / "evil.pt"
    torch.save({"payload": RunsACommand()}, path)
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    message = str(info.value)
    assert f"{os.system.__module__}.system" in message and "runs code" in message
    assert "add_safe_globals" not in message and "trusted=" not in message


def test_a_corrupt_pickle_stream_is_not_an_allowlist_problem(tmp_path: Path) -> None:
    path = atomic_save({"w": torch.ones(3)}, tmp_path / "a.pt")
    start, _ = next(span for name, span in record_spans(path).items() if name.endswith("data.pkl"))
    data = bytearray(path.read_bytes())
    data[start + 2 : start + 6] = b"\xee\xee\xee\xee"  # opcodes no unpickler knows
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError) as info:
        load_file(path)
    message = str(info.value)
    assert "is corrupt" in message and "data.pkl" in message and "object structure" in message
    assert "add_safe_globals" not in message


def test_flipped_tensor_bytes_name_the_entry_and_can_be_loaded_unverified(
    tmp_path: Path,
) -> None:
    path = atomic_save(
        {"model": {"w": torch.arange(100.0), "b": torch.zeros(3)}}, tmp_path / "a.pt"
    )
    start, _ = next(span for name, span in record_spans(path).items() if name.endswith("data/0"))
    data = bytearray(path.read_bytes())
    data[start + 7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"a\.pt is corrupt: entry 'model\.w', record"):
        load_file(path)
    assert not torch.equal(load_file(path, verify=False)["model"]["w"], torch.arange(100.0))


def test_files_without_checksums_load(tmp_path: Path) -> None:
    path = tmp_path / "plain.pt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save({"w": torch.ones(2)}, path)
    finally:
        torch.serialization.set_crc32_options(True)
    assert verify_records(path) is None
    assert torch.equal(load_file(path)["w"], torch.ones(2))


def test_a_full_disk_is_named_with_the_space_needed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_space(obj: Any, target: Any) -> None:
        raise RuntimeError(
            "[enforce fail at inline_container.cc:672] . unexpected pos 24512 vs 24412"
        )

    monkeypatch.setattr(torch, "save", no_space)
    monkeypatch.setattr("shutil.disk_usage", lambda _: SimpleNamespace(free=1000))
    with pytest.raises(CheckpointError) as info:
        atomic_save({"w": torch.ones(1000)}, tmp_path / "a.pt")
    message = str(info.value)
    assert "no space left on device" in message and "4000 bytes" in message
    assert "1000 bytes are free" in message and "inline_container" not in message
    assert list(tmp_path.iterdir()) == []


def test_map_location_defaults_to_cpu(tmp_path: Path) -> None:
    path = atomic_save({"w": torch.ones(2)}, tmp_path / "a.pt")
    assert load_file(path)["w"].device.type == "cpu"
    assert load_file(path, map_location=torch.device("cpu"))["w"].device.type == "cpu"


def test_unsafe_entries_names_key_paths() -> None:
    state = {"model": {"w": torch.ones(1)}, "sched": {"fn": len, "steps": [1, 2.0]}}
    assert unsafe_entries(state) == ["sched.fn (builtin_function_or_method)"]
    assert unsafe_entries({"a": (1, "x", None, torch.float32, torch.Size([2]))}) == []


# ----------------------------------------------------------------- model weights
def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))


@pytest.mark.parametrize("prefix", ["", "module.", "_orig_mod.", "module._orig_mod."])
def test_weights_load_with_or_without_wrapper_prefixes(prefix: str) -> None:
    source, target = _net(), nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    state = {prefix + k: v for k, v in source.state_dict().items()}
    load_model_state(target, state)
    assert all(
        torch.equal(a, b)
        for a, b in zip(source.state_dict().values(), target.state_dict().values(), strict=True)
    )


def test_plain_weights_load_into_a_compiled_model() -> None:
    source = _net()
    compiled = torch.compile(_net())  # compilation is lazy: nothing is compiled here
    load_model_state(compiled, source.state_dict())  # type: ignore[arg-type]
    inner = compiled._orig_mod  # type: ignore[union-attr]
    assert torch.equal(inner[0].weight, source[0].weight)  # type: ignore[index]


def test_a_submodule_named_module_keeps_its_prefix() -> None:
    class Holder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.module = nn.Linear(2, 2)

    state = Holder().state_dict()
    assert strip_wrapper_prefixes(state, Holder().state_dict()) == state
    load_model_state(Holder(), state)


def test_strict_loading_lists_missing_and_unexpected_keys() -> None:
    state = dict(_net().state_dict())
    state.pop("0.bias")
    state["extra.weight"] = torch.zeros(1)
    with pytest.raises(CheckpointError) as info:
        load_model_state(_net(), state, source="run.pt")
    message = str(info.value)
    assert "run.pt" in message and "missing key(s) [0.bias]" in message
    assert "unexpected key(s) [extra.weight]" in message and "strict=False" in message
    load_model_state(_net(), {k: v for k, v in state.items() if k != "extra.weight"}, strict=False)


def test_shape_mismatch_is_named() -> None:
    state = dict(_net().state_dict())
    state["0.weight"] = torch.zeros(5, 3)
    with pytest.raises(CheckpointError, match=r"0\.weight: checkpoint \(5, 3\) vs model \(4, 3\)"):
        load_model_state(_net(), state)


# ----------------------------------------------------------------- RNG states
def test_rng_states_round_trip_through_a_weights_only_file(tmp_path: Path) -> None:
    import random

    import numpy as np

    state = capture_rng()
    expected = (torch.rand(3), random.random(), np.random.rand(2))
    path = atomic_save(state, tmp_path / "rng.pt")
    torch.manual_seed(123)
    random.seed(1)
    np.random.seed(2)
    restore_rng(load_file(path))
    again = (torch.rand(3), random.random(), np.random.rand(2))
    assert torch.equal(expected[0], again[0]) and expected[1] == again[1]
    assert (expected[2] == again[2]).all()


# ----------------------------------------------------------------- the manager
def newest(folder: Path) -> Opened:
    """What a folder of checkpoints opens as (its newest complete, readable checkpoint)."""
    return open_checkpoint(folder)


def _periodic(manager: CheckpointManager, epoch: int, step: int) -> Path:
    return manager.save_periodic(FileWriter(manager.comm), {"step": step}, epoch, step)


def test_manager_keeps_the_last_n_and_points_at_the_newest(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_last=2)
    for step in (2, 4, 6):
        _periodic(manager, 0, step)
    names = sorted(p.name for p in manager.periodic())
    assert names == [periodic_name(0, 4), periodic_name(0, 6)]
    assert (tmp_path / LATEST).read_text().count(periodic_name(0, 6)) == 1
    found = newest(tmp_path)
    assert found is not None and found[1]["step"] == 6


def test_a_step_save_at_the_epochs_end_gives_way_to_the_epochs(tmp_path: Path) -> None:
    """Saves every 4 steps of an 8-step epoch and at every epoch's end: the step save at step
    8 (mid-epoch 1) is deleted once the epoch's checkpoint of that same step is committed (it
    holds that step and the epoch's end), so a step has one checkpoint; the others stay."""
    manager = _manager(tmp_path, keep_last=2)
    _periodic(manager, 0, 4)
    _periodic(manager, 0, 8)  # the epoch's last step, before its end
    assert sorted(p.name for p in manager.periodic()) == [periodic_name(0, 4), periodic_name(0, 8)]
    _periodic(manager, 1, 8)  # the epoch's end: the two newest distinct steps are kept
    assert sorted(p.name for p in manager.periodic()) == [periodic_name(0, 4), periodic_name(1, 8)]
    _periodic(manager, 1, 12)
    assert sorted(p.name for p in manager.periodic()) == [periodic_name(1, 8), periodic_name(1, 12)]


def test_an_unreadable_newest_checkpoint_falls_back_to_the_previous(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_last=3)
    for step in (2, 4):
        _periodic(manager, 0, step)
    (tmp_path / periodic_name(0, 4)).write_bytes(b"torn")
    found = newest(tmp_path)
    assert found is not None and found[1]["step"] == 2


def test_a_corrupt_pointer_falls_back_to_the_newest_file(tmp_path: Path) -> None:
    manager = _manager(tmp_path, keep_last=3)
    for step in (2, 4):
        _periodic(manager, 0, step)
    (tmp_path / LATEST).write_text("{not json")
    found = newest(tmp_path)
    assert found is not None and found[1]["step"] == 4


def test_a_folder_without_a_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    _manager(tmp_path)
    with pytest.raises(CheckpointError, match="no complete checkpoint in"):
        newest(tmp_path)


def test_best_is_a_link_to_the_improving_checkpoint(tmp_path: Path) -> None:
    manager = _manager(tmp_path, save_best=True, mode="max", keep_last=2)
    first = _periodic(manager, 1, 5)
    ranking = manager.rank(0.5, 1, 5)
    assert ranking.best
    manager.keep(ranking, first, write=lambda target: pytest.fail(f"wrote {target}"))
    assert (tmp_path / "best.pt").stat().st_ino == first.stat().st_ino  # no second write
    _periodic(manager, 2, 10)
    assert not manager.rank(0.4, 2, 10).best
    _periodic(manager, 3, 15)  # rotates the first periodic file away; best.pt stays
    assert not first.exists()
    assert load_file(tmp_path / "best.pt")["step"] == 5


def test_manager_needs_a_folder() -> None:
    with pytest.raises(CheckpointError, match="dir="):
        CheckpointManager(CheckpointConfig(), NullCommunicator())


# ----------------------------------------------------------------- config and environment
def test_checkpoint_config_validation_names_the_field() -> None:
    with pytest.raises(ConfigError, match=r"checkpoint.keep_last"):
        HandlerConfig.from_dict({"checkpoint": {"keep_last": 0}})
    with pytest.raises(ConfigError, match="every_n_epochs or every_n_steps"):
        HandlerConfig.from_dict({"checkpoint": {"every_n_epochs": None}})
    assert HandlerConfig.from_dict({"checkpoint": {"every_n_epochs": None, "save_last": False}})


@given(
    torchrun=st.one_of(st.none(), st.integers(0, 50).map(str), st.text(max_size=3)),
    slurm=st.one_of(st.none(), st.integers(0, 50).map(str), st.text(max_size=3)),
    supervise=st.one_of(st.none(), st.integers(0, 50).map(str), st.text(max_size=3)),
)
def test_restart_count_reads_torchrun_then_slurm_then_supervise(
    torchrun: str | None, slurm: str | None, supervise: str | None
) -> None:
    given = {
        "TORCHELASTIC_RESTART_COUNT": torchrun,
        "SLURM_RESTART_COUNT": slurm,
        "NN_HANDLER_RESTART_COUNT": supervise,
    }
    env = {name: value for name, value in given.items() if value is not None}

    def parsed(value: str | None) -> int:
        text = (value or "").strip()
        return int(text) if text and all(c in "0123456789" for c in text) else 0

    expected = parsed(torchrun) or parsed(slurm) or parsed(supervise)
    assert restart_count(env) == expected


def test_restart_count_ignores_non_ascii_digits() -> None:
    assert restart_count({"TORCHELASTIC_RESTART_COUNT": "\u00b9", "SLURM_RESTART_COUNT": "2"}) == 2
