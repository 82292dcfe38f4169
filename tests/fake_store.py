"""The checkpoint store seam (CheckpointStore) faked in 40 lines: a folder with no lock, no
manifest and no guard on latest.json, the runs kept in memory."""

import contextlib
import json
import os
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from nn_handler.checkpoint.naming import is_checkpoint_name
from nn_handler.checkpoint.store import Listing
from nn_handler.checkpoint.store.files import remove_orphans, staging_path


class FakeStore:
    def __init__(self, dir: Path) -> None:
        self.dir, self.runs, self.latest = dir, dict[str, str | None](), dir / "latest.json"

    @contextlib.contextmanager
    def session(self, lead: bool) -> Iterator[None]:
        self.dir.mkdir(parents=True, exist_ok=True)
        if lead:
            remove_orphans(self.dir)
        yield

    def checkpoints(self) -> Listing:
        found = [p for p in sorted(self.dir.glob("*")) if is_checkpoint_name(p.name)]
        pointer = lambda: json.loads(self.latest.read_text()) if self.latest.exists() else None  # noqa: E731
        return Listing(found, lambda path: self.runs.get(path.name), pointer, str(self.dir))

    def write_latest(self, pointer: Mapping[str, Any]) -> None:
        self.latest.write_text(json.dumps(dict(pointer)))

    def commit(self, target: Path, source: Path | str, run: str | None, _: Any = None) -> None:
        if isinstance(source, str):  # a copy of a committed one
            copy = shutil.copytree if (self.dir / source).is_dir() else shutil.copyfile
            source = Path(copy(self.dir / source, self.staging(target, True)))
        os.replace(source, target)
        self.runs[target.name] = run

    def remove(self, path: Path) -> None:
        shutil.rmtree(path) if path.is_dir() else path.unlink()

    def put(self, staging: Path, files: list[Path], name: str, _: Any = None) -> dict[str, Any]:
        return {}

    def fetch(self, name: str) -> Path:
        return self.dir / name

    def staging(self, target: Path, folder: bool = False) -> Path:
        return staging_path(target, folder)

    def flush(self) -> None:
        pass
