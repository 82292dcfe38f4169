"""The interpreters the suite starts get tests/fast_exit first on their PYTHONPATH, and its
sitecustomize freezes the garbage collector's objects as their last exit handler."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.interpreters import FAST_EXIT, python_path

PROBE = """
import atexit, gc, sitecustomize
print(sitecustomize.__file__)
before = gc.get_freeze_count()
atexit._run_exitfuncs()
print(before, gc.get_freeze_count() > 0)
"""


def test_python_path_puts_the_fast_exit_folder_first_once_and_drops_empty_entries() -> None:
    assert python_path() == str(FAST_EXIT)
    joined = python_path("/a", "", FAST_EXIT, "/a", "/b")
    assert joined.split(os.pathsep) == [str(FAST_EXIT), "/a", "/b"]


def test_an_interpreter_the_suite_starts_freezes_its_objects_when_it_exits() -> None:
    # The session's environment (tests/conftest.py), as run_command and torchrun pass it on.
    assert os.environ["PYTHONPATH"].split(os.pathsep)[0] == str(FAST_EXIT)
    done = subprocess.run(
        [sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    where, frozen = done.stdout.splitlines()
    assert where == str(FAST_EXIT / "sitecustomize.py")
    assert frozen == "0 True"  # nothing frozen until the exit handlers ran, then everything
