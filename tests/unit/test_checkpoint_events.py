"""The checkpoint events hooks can use (training/checkpoint_events.py) and the parts of the Ray
Train bridge (nn_handler/ray_train.py) that run without Ray: a listener hears each periodic
checkpoint once it is committed (single files; sharded folders, also written in the
background), a resume source names the checkpoint the first fit starts from, and
RayTrainReport does nothing outside a Ray Train worker. The bridge inside Ray is tested on a
real local cluster in tests/distributed/test_ray_train.py."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from torch import nn

from nn_handler import ConfigError, HandlerConfig, Hook, NNHandler
from nn_handler.checkpoint.format import is_sharded
from nn_handler.checkpoint.store import LATEST
from nn_handler.checkpoint.store.files import TMP_MARKER, remove_orphans
from nn_handler.ray_train import RayTrainReport, in_ray_train_worker, report_folder
from tests.training_helpers import max_difference, mlp, regression_data, sgd, state_of

DATA = regression_data()  # 40 samples, batches of 8: 5 steps an epoch


class Listener(Hook):
    """Records each committed checkpoint with what was on disk when it was told."""

    def __init__(self) -> None:
        super().__init__()
        self.told: list[tuple[str, int, int, bool, str]] = []

    def checkpoint_committed(self, path: Path, epoch: int, step: int) -> None:
        latest = json.loads((path.parent / LATEST).read_text())["checkpoint"]
        complete = is_sharded(path) if path.is_dir() else path.is_file()
        self.told.append((path.name, epoch, step, complete, latest))


class Source(Hook):
    def __init__(self, path: Path | None) -> None:
        super().__init__()
        self.path = path
        self.asked = 0

    def checkpoint_to_resume(self) -> Path | None:
        self.asked += 1
        return self.path


def handler(folder: Path, hooks: list[Hook], **checkpoint: Any) -> NNHandler:
    config = HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8, "shuffle": True, "seed": 3},
            "trainer": {"progress_bar": False},
            "checkpoint": {"dir": str(folder), "every_n_steps": 3, "keep_last": 10, **checkpoint},
        }
    )
    return NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=hooks)


#: Steps 3, 5 (epoch 1's end), 6, 9 and 10 (epoch 2's end): the checkpoint names and positions.
TOLD = [(0, 3), (1, 5), (1, 6), (1, 9), (2, 10)]


@pytest.mark.parametrize(
    ("what", "settings"),
    [
        ("single files", {}),
        ("sharded folders", {"format": "sharded"}),
        ("sharded folders written in the background", {"format": "sharded", "async_save": True}),
    ],
)
def test_a_listener_hears_each_periodic_checkpoint_once_it_is_committed(
    tmp_path: Path, what: str, settings: dict[str, Any]
) -> None:
    listener = Listener()
    with handler(tmp_path, [listener], **settings) as h:
        h.train(DATA, epochs=2)
    suffix = "" if settings else ".pt"
    names = [f"ckpt-e{e:04d}-s{s:08d}{suffix}" for e, s in TOLD]
    expected = [(name, e, s, True, name) for name, (e, s) in zip(names, TOLD, strict=True)]
    if settings.get("async_save"):
        # Told when the next save (or the fit's end) has waited for it: complete and named by
        # latest.json then, but latest.json may already name the next one.
        assert [t[:4] for t in listener.told] == [t[:4] for t in expected], what
    else:
        assert listener.told == expected, what


def test_a_resume_source_names_the_checkpoint_the_first_fit_starts_from(tmp_path: Path) -> None:
    with handler(tmp_path / "a", []) as h:
        h.train(DATA, epochs=2)
        straight = state_of(h.model)
    # A new folder and resume='never': only the source can make it resume (from epoch 1's end).
    source = Source(tmp_path / "a" / "ckpt-e0001-s00000005.pt")
    with handler(tmp_path / "b", [source], resume="never") as h:
        h.train(DATA, epochs=1)  # already done: it resumed from epoch 1's end
        assert h.trainer.state.global_step == 5 and len(h.history) == 1
        h.train(DATA, epochs=2)  # a later fit of the same trainer continues, not asked again
        assert h.trainer.state.global_step == 10
        assert max_difference(state_of(h.model), straight) == 0.0
    assert source.asked == 1


def test_a_resume_source_with_nothing_to_give_leaves_the_policy_in_charge(tmp_path: Path) -> None:
    with handler(tmp_path, []) as h:
        h.train(DATA, epochs=1)
    source = Source(None)
    with handler(tmp_path, [source], resume="auto") as h:
        h.train(DATA, epochs=2)
        assert h.history["epoch"] == [1.0, 2.0]  # epoch 1 from the checkpoint
    assert source.asked == 1


def test_ray_train_report_is_a_no_op_outside_a_ray_train_worker(tmp_path: Path) -> None:
    # Not even importing Ray when the process has not.
    code = (
        "import sys; from nn_handler.ray_train import RayTrainReport; "
        "hook = RayTrainReport(); print(hook.active, 'ray' in sys.modules)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.split() == ["False", "False"]
    import ray  # installed by the ray extra; imported, but this is no Ray Train worker

    assert ray is not None and not in_ray_train_worker()
    report = RayTrainReport()
    assert not report.active
    with handler(tmp_path, [report]) as h:
        h.train(DATA, epochs=1)  # commits checkpoints: the hook hears them and does nothing
        assert report.checkpoint_to_resume() is None
        assert h.trainer.state.global_step == 5


def test_ray_train_report_without_a_checkpoint_folder_warns_in_a_ray_worker(
    monkeypatch: pytest.MonkeyPatch, lines: list[str]
) -> None:
    report = RayTrainReport()
    config = HandlerConfig.from_dict({"trainer": {"progress_bar": False}})
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config, hooks=[report]):
        report.before_train()  # outside Ray: nothing to say
        assert not [line for line in lines if "RayTrainReport" in line]
        # As in a Ray Train worker (the reporting itself is tested in a real Ray cluster).
        monkeypatch.setattr("nn_handler.ray_train.in_ray_train_worker", lambda: True)
        assert report.active
        report.before_train()
    warned = [line for line in lines if "RayTrainReport" in line]
    assert warned == [
        "RayTrainReport: no checkpoint folder, so no checkpoint reaches Ray and a group Ray "
        "restarts starts afresh; set checkpoint.dir (a local folder) to report them"
    ]


def test_the_folder_reported_to_ray_links_the_checkpoint_and_is_removed(tmp_path: Path) -> None:
    single = tmp_path / "ckpt-e0001-s00000005.pt"
    single.write_bytes(b"weights")
    sharded = tmp_path / "ckpt-e0001-s00000010"
    sharded.mkdir()
    (sharded / "a.distcp").write_bytes(b"shard")
    (sharded / "manifest.json").write_text("{}")
    for path in (single, sharded):
        with report_folder(path) as folder:
            assert TMP_MARKER in folder.name and folder.parent == tmp_path
            assert [p.name for p in folder.iterdir()] == [path.name]
            pairs = (
                [(folder / path.name, path)]
                if path.is_file()
                else [(folder / path.name / f.name, f) for f in path.iterdir()]
            )
            assert len(pairs) == (1 if path.is_file() else 2)
            for linked, original in pairs:  # hard links, not copies
                assert linked.stat().st_ino == original.stat().st_ino
        assert not folder.exists()
    # A folder left by a killed process is swept with the other leftovers.
    leftover = tmp_path / f".{single.name}{TMP_MARKER}ray"
    leftover.mkdir()
    assert leftover in remove_orphans(tmp_path)


def test_reporting_a_checkpoint_that_is_not_on_this_machine_is_a_config_error(
    tmp_path: Path,
) -> None:
    with (
        pytest.raises(ConfigError, match=r"set checkpoint.dir to a local folder"),
        report_folder(tmp_path / "ckpt-e0001-s00000005.pt"),
    ):
        pass
    assert list(tmp_path.iterdir()) == []
