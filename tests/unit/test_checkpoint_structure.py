"""The checkpoint code's shape, pinned: one commit protocol (only the store implementations
rename a checkpoint into place or write its manifest), one manifest format (one module knows
it), one verifier (the only caller of the CRC-32 helpers, and the only code comparing a
checksum with the one recorded)."""

from __future__ import annotations

import ast
from pathlib import Path

import nn_handler

PACKAGE = Path(nn_handler.__file__).parent
CHECKPOINT_CODE = sorted(
    [*(PACKAGE / "checkpoint").rglob("*.py"), *(PACKAGE / "training").glob("checkpoint*.py")]
)


def imported_modules(path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_only_checksum_py_computes_checksums() -> None:
    assert len(CHECKPOINT_CODE) > 30  # the scan sees the checkpoint code
    hashing = {"zlib", "hashlib", "binascii", "crc32c"}
    computing = sorted(
        str(path.relative_to(PACKAGE))
        for path in CHECKPOINT_CODE
        if imported_modules(path) & hashing
    )
    assert computing == ["checkpoint/checksum.py"]


def test_one_module_knows_the_manifest_formats_and_one_checks_against_them() -> None:
    formats = ('"nn_handler.manifest"', '"nn_handler.remote-manifest"')
    knowing = sorted(
        str(path.relative_to(PACKAGE))
        for path in CHECKPOINT_CODE
        if any(name in path.read_text() for name in formats)
    )
    assert knowing == ["checkpoint/manifest.py"]
    # Comparing a checksum with the one a manifest stored happens in the verifier only.
    comparing = sorted(
        str(path.relative_to(PACKAGE))
        for path in CHECKPOINT_CODE
        if '!= entry["crc32"]' in path.read_text()
        or "!= stored" in path.read_text()
        or 'entry.get("crc32"' in path.read_text()
    )
    assert comparing == ["checkpoint/verify.py"]


#: The store's own helpers that put a file or folder in its final place.
COMMITTING_HELPERS = {"atomic_save", "atomic_write_bytes", "atomic_write_json", "atomic_link",
                      "commit_file", "commit_folder", "link_tree"}  # fmt: skip
#: Modules outside checkpoint/store/ that put files in place themselves, none a checkpoint.
NOT_CHECKPOINTS = {
    "distributed/_worker.py": "a launched worker's result file for its launcher",
    "tracking/csv_logger.py": "the CSV tracker's metrics.csv",
    "ray_train.py": "the hard links of a committed checkpoint that Ray copies (a view of it)",
}


def commits(path: Path) -> list[str]:
    """Every call in ``path`` that puts a file or folder in its final place, as
    ``line: what``: os.replace / os.rename / os.renames and shutil.move under any import name
    (``from os import replace``, ``import os as o``), ``.rename(x)`` and a one-argument
    ``.replace(x)`` (pathlib's; ``str.replace`` takes two), and the store's helpers."""
    tree = ast.parse(path.read_text())
    modules = {"os": "os", "shutil": "shutil"}  # the name a module is called by -> module
    direct: dict[str, str] = {}  # a function imported by name -> what it is
    moving = {"os": {"replace", "rename", "renames"}, "shutil": {"move"}}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in moving:
                    modules[alias.asname or alias.name] = alias.name
        elif isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                if alias.name in moving.get(node.module, set()):
                    direct[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                elif node.module.startswith("nn_handler") and alias.name in COMMITTING_HELPERS:
                    direct[alias.asname or alias.name] = alias.name
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        func, what = node.func, None
        if isinstance(func, ast.Name):
            what = direct.get(func.id)
        elif isinstance(func, ast.Attribute):
            owner = func.value.id if isinstance(func.value, ast.Name) else None
            module = modules.get(owner or "")
            if module is not None and func.attr in moving[module]:
                what = f"{module}.{func.attr}"
            elif func.attr == "rename" or func.attr in COMMITTING_HELPERS:
                what = f".{func.attr}"
            elif func.attr == "replace" and len(node.args) == 1 and not node.keywords:
                what = ".replace"
        if what is not None:
            found.append(f"{node.lineno}: {what}")
    return found


def test_only_the_store_implementations_commit() -> None:
    """A checkpoint becomes trusted by a rename (a local file system) or by its manifest
    written (in a local folder, or beside it on an object store): both happen in
    checkpoint/store/ only. Every module of the package is read for calls that put a file in
    its final place; outside the store only the few named in NOT_CHECKPOINTS do, for files
    that are not checkpoints. Writers write into the staging place and import no store."""
    found = {
        str(path.relative_to(PACKAGE)): commits(path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if not str(path.relative_to(PACKAGE)).startswith("checkpoint/store/")
    }
    outside = {name: calls for name, calls in found.items() if calls}
    assert sorted(outside) == sorted(NOT_CHECKPOINTS), outside
    inside = [commits(path) for path in (PACKAGE / "checkpoint" / "store").rglob("*.py")]
    assert any(inside)  # the scan sees the store's own commits
    writers = ["single_file.py", "sharded.py", "checksumming_writer.py"]
    for name in writers:
        imported = imported_modules(PACKAGE / "checkpoint" / name)
        assert not {m for m in imported if m.startswith("nn_handler.checkpoint.store")}, name


def test_the_commit_scan_sees_every_way_to_put_a_file_in_place(tmp_path: Path) -> None:
    """The scan above is not a list of names that a new spelling escapes: each way seen in
    the issue that reported it (consolidate.py's atomic_save, Path.replace, an import of
    os.replace by name or under an alias, shutil.move) is found; str.replace is not."""
    ways = {
        "from nn_handler.checkpoint.store.files import atomic_save as save\nsave(x, p)": (
            "atomic_save"
        ),
        "from pathlib import Path\nPath(a).replace(b)": ".replace",
        "from os import replace\nreplace(a, b)": "os.replace",
        "import os as o\no.rename(a, b)": "os.rename",
        "import shutil\nshutil.move(a, b)": "shutil.move",
        "from nn_handler.checkpoint.store import files\nfiles.commit_file(a, b)": ".commit_file",
    }
    for code, what in ways.items():
        module = tmp_path / "m.py"
        module.write_text(code + "\n")
        assert [line.split(": ")[1] for line in commits(module)] == [what], code
    module.write_text("name = 'a-b'.replace('-', '_')\n")
    assert commits(module) == []


def test_only_the_verifier_computes_checksums() -> None:
    """checksum.py's functions that compute a CRC-32 are called from the verifier only (the
    writers, the uploads and the downloads ask it for entries and checks)."""
    computing = {"_crc32", "crc32", "Crc32", "span_crc32", "file_crc32"}
    users = []
    for path in CHECKPOINT_CODE:
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom):
                continue
            if (
                node.module == "nn_handler.checkpoint.checksum"
                and {alias.name for alias in node.names} & computing
            ):
                users.append(str(path.relative_to(PACKAGE)))
    assert users == ["checkpoint/verify.py"]


def _outside(*allowed: str) -> list[Path]:
    """Every module of the package but ``allowed`` (paths relative to it; a folder ends with
    a slash)."""
    return [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if not any(
            str(path.relative_to(PACKAGE)).startswith(a) if a.endswith("/") else
            str(path.relative_to(PACKAGE)) == a
            for a in allowed
        )
    ]  # fmt: skip


def _calls(path: Path) -> list[tuple[str, str]]:
    """(the function it is in, the name called) for every call in ``path``, a method call by
    its attribute name."""
    found: list[tuple[str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        for child in ast.iter_child_nodes(node):
            inner = function
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inner = child.name
            if isinstance(child, ast.Call):
                func = child.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                found.append((inner, name))
            visit(child, inner)

    visit(ast.parse(path.read_text()), "<module>")
    return found


def test_one_module_decides_what_a_path_holds() -> None:
    """File or folder, checkpoint or folder of checkpoints: format.py decides (``is_sharded``,
    ``kind_of``); the opener and the stores ask it, nobody else names ``is_sharded``, and no
    other checkpoint code (nor a reader: the handler, the CLI, Ray, the saved run) asks a
    path ``is_dir()``."""
    naming = sorted(
        str(path.relative_to(PACKAGE))
        for path in _outside("checkpoint/store/")
        if "is_sharded" in path.read_text()
    )
    assert naming == ["checkpoint/format.py", "checkpoint/opening.py"]
    allowed = ("checkpoint/store/", "checkpoint/format.py", "checkpoint/opening.py")
    readers = [PACKAGE / name for name in ("handler.py", "cli.py", "ray_train.py")]
    asking = sorted(
        str(path.relative_to(PACKAGE))
        for path in [*CHECKPOINT_CODE, *readers, PACKAGE / "training" / "saved_run.py"]
        if not str(path.relative_to(PACKAGE)).startswith(allowed)
        and ".is_dir()" in path.read_text()
    )
    assert asking == []
    assert ".is_dir()" in (PACKAGE / "checkpoint" / "format.py").read_text()  # the scan sees it


def test_checkpoints_are_opened_in_one_module_by_at_most_four_functions() -> None:
    """Reading a checkpoint's bytes (``load_file``, a store's ``fetch``, a folder's
    ``top_file``) happens in checkpoint/opening.py only, in at most 4 functions; every other
    reader (NNHandler.load, a resume, inspect, consolidate, rotation's owner check) asks it.
    Outside: io.py's own definition, and init_weights' weights file (any torch.save of a
    state dict, not a checkpoint)."""
    opening = {"load_file", "fetch", "top_file"}
    outside = {
        f"{path.relative_to(PACKAGE)}:{function}"
        for path in _outside("checkpoint/store/", "checkpoint/opening.py", "checkpoint/format.py")
        for function, name in _calls(path)
        if name in opening
    }
    assert outside == {"strategies/meta_init.py:load_weights_file"}, outside
    inside = {
        function
        for function, name in _calls(PACKAGE / "checkpoint" / "opening.py")
        if name in opening | {"read"}
    }
    assert inside == {"read", "open_checkpoint", "open_on_every_rank", "_newest"}


def test_latest_json_is_named_by_the_store_only() -> None:
    """The pointer to the newest checkpoint is read and written by the store: the file's name
    is a string in one module's code, and only the store's modules use its constant."""
    literal = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Constant)
                and node.value == "latest.json"
                and id(node) not in docstrings
            ):
                literal.append(str(path.relative_to(PACKAGE)))
    assert literal == ["checkpoint/store/local.py"]
    using = sorted(
        str(path.relative_to(PACKAGE))
        for path in _outside("checkpoint/store/")
        if "LATEST"
        in {n.id for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Name)}
        or any(
            isinstance(n, ast.ImportFrom) and "LATEST" in {a.name for a in n.names}
            for n in ast.walk(ast.parse(path.read_text()))
        )
    )
    assert using == []


def test_the_handler_knows_no_checkpoint_internals() -> None:
    """NNHandler loads and records runs through the Trainer's parts (training/saved_run.py):
    it imports nothing from checkpoint/ nor the Trainer's checkpoint format."""
    imported = imported_modules(PACKAGE / "handler.py")
    assert len(imported) > 10  # the scan sees the handler's imports
    inside = {m for m in imported if m.startswith("nn_handler.checkpoint")}
    assert inside | ({"nn_handler.training.checkpoint_format"} & imported) == set()


def test_one_route_saves_every_checkpoint() -> None:
    """A file or a folder, to a folder or an object store, now or in the background: one
    route (checkpoint/saving.py) hands the writer's files to the store and has it commit;
    nobody else calls a store's ``staging``, ``put`` or ``commit``, and nobody outside the
    format, the opener and the stores asks whether a store uploads or a writer exists."""
    committing = {"staging", "put", "commit"}  # (names other parts use for other things)
    readers = [PACKAGE / name for name in ("handler.py", "cli.py", "ray_train.py")]
    outside = {
        f"{path.relative_to(PACKAGE)}:{function}"
        for path in [*CHECKPOINT_CODE, *readers, PACKAGE / "training" / "saved_run.py"]
        if not str(path.relative_to(PACKAGE)).startswith("checkpoint/store/")
        for function, name in _calls(path)
        if name in committing
    }
    route = {"save", "_write_and_put", "_finish", "copy"}
    assert outside == {f"checkpoint/saving.py:{name}" for name in route}, outside
    allowed = ("checkpoint/store/", "checkpoint/format.py", "checkpoint/opening.py")
    asking = sorted(
        str(path.relative_to(PACKAGE))
        for path in [*CHECKPOINT_CODE, *readers]
        if not str(path.relative_to(PACKAGE)).startswith(allowed)
        and (".uploads" in path.read_text() or "writer is None" in path.read_text())
    )
    assert asking == []


def test_the_trainers_checkpointing_stays_a_thin_layer() -> None:
    """The Trainer's checkpointing part asks the checkpoint layer through few names (the
    manager, the opener, the registry, the run's identity, the save route's two entries, the
    shards' check), and stays small, as the Trainer does."""
    path = PACKAGE / "training" / "checkpointing.py"
    names = [
        alias.name
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom)
        and (node.module or "").startswith("nn_handler.checkpoint")
        for alias in node.names
    ]
    assert 5 <= len(names) <= 12, names
    assert len(path.read_text().splitlines()) <= 420
    assert len((PACKAGE / "training" / "trainer.py").read_text().splitlines()) <= 450


def test_the_store_seam_has_ten_members() -> None:
    """The CheckpointStore Protocol's members (21 at 5e6e8ea): at most 10, so that a fake fits
    in 40 lines (tests/fake_store.py, run by the store contract) and a new member is a
    decision, not a drift."""
    from nn_handler.checkpoint.store import CheckpointStore

    tree = ast.parse((PACKAGE / "checkpoint" / "store" / "__init__.py").read_text())
    protocol = next(
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == CheckpointStore.__name__
    )
    members = [
        node.name if isinstance(node, ast.FunctionDef) else ast.unparse(node.target)
        for node in protocol.body
        if isinstance(node, (ast.FunctionDef, ast.AnnAssign))
    ]
    assert "checkpoints" in members and "fetch" in members  # the scan sees the Protocol
    assert len(members) <= 10, members
