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


def _calls(path: Path) -> set[str]:
    """``module.function`` (``os.replace``) and ``.method`` (``.rename``) calls in ``path``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            owner = node.func.value
            prefix = owner.id if isinstance(owner, ast.Name) and owner.id == "os" else ""
            found.add(f"{prefix}.{node.func.attr}")
    return found


def test_only_the_store_implementations_commit() -> None:
    """A checkpoint becomes trusted by a rename (a local file system) or by its manifest
    written (in a local folder, or beside it on an object store): both happen in
    checkpoint/store/ only. Writers write into the staging place and import no store."""
    committing = {"os.replace", "os.rename", ".rename", ".to_bytes"}
    found = sorted(
        str(path.relative_to(PACKAGE)) for path in CHECKPOINT_CODE if _calls(path) & committing
    )
    assert found and all(name.startswith("checkpoint/store/") for name in found), found
    writers = ["single_file.py", "sharded.py", "checksumming_writer.py"]
    for name in writers:
        imported = imported_modules(PACKAGE / "checkpoint" / name)
        assert not {m for m in imported if m.startswith("nn_handler.checkpoint.store")}, name


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
