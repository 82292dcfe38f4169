"""The checkpoint code's shape, pinned: one module computes checksums (so that the number of
times each byte is checksummed is decided in one place), one reads and writes manifests, and
one checks objects against them."""

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
