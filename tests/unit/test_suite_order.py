"""The suite's own scheduling: the files started first (tests/conftest.py's LONGEST_FIRST)
exist, so that renaming one cannot silently send it back to the end of the session."""

from __future__ import annotations

from pathlib import Path

from tests.conftest import LONGEST_FIRST

TESTS = Path(__file__).parents[1]


def test_the_longest_files_named_first_exist_once_each() -> None:
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)
    missing = [name for name in LONGEST_FIRST if not (TESTS / name).is_file()]
    assert not missing, f"tests/conftest.py's LONGEST_FIRST names files that are gone: {missing}"
