"""The documentation site builds with warnings as errors (mkdocs --strict): every page in the
nav exists, every internal link resolves, and the API reference renders every module."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.harness import run_command

ROOT = Path(__file__).resolve().parents[2]


def test_docs_build_strictly_with_the_api_reference(tmp_path: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "mkdocs",
        "build",
        "--strict",
        "-q",
        "-f",
        str(ROOT / "mkdocs.yml"),
        "-d",
        str(tmp_path / "site"),
    ]
    code, output = run_command(command, timeout=240)
    assert code == 0, output
    api = (tmp_path / "site" / "api" / "training" / "index.html").read_text()
    assert "Every rank must call this" in api and "resume" in api
    for page in ("checkpoints", "troubleshooting", "architecture", "precision_ema"):
        assert (tmp_path / "site" / page / "index.html").is_file(), page


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert pages and all(page in nav for page in pages), [p for p in pages if p not in nav]
