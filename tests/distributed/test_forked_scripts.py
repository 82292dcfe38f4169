"""tests/forked.py runs a script as ``python script.py`` would: the same exit status and output
as a fresh interpreter (run_commands) for every way a script can end, the same argv, paths and
environment, and a hang is killed at its bound with the output so far."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from tests.forked import Script, run_script, run_script_split, run_scripts
from tests.harness import GroupRunError, run_commands

pytestmark = pytest.mark.distributed

PROBE = textwrap.dedent(
    """
    import atexit, json, os, signal, sys, threading, time

    signal.signal(signal.SIGINT, signal.default_int_handler)  # also in a background job
    mode = sys.argv[1]
    print("out", flush=True)
    print("err", file=sys.stderr, flush=True)
    atexit.register(lambda: print("atexit ran", flush=True))
    if mode == "facts":
        print(json.dumps({
            "argv": sys.argv, "file": __file__, "name": __name__, "path0": sys.path[0],
            "cwd": os.getcwd(), "added": os.environ.get("ADDED"),
            "dropped": os.environ.get("NNH_FORKED_DROPPED"),
            "helper": __import__("probe_helper").VALUE,
            "start_method": __import__("multiprocessing").get_start_method(allow_none=True),
        }))
    elif mode == "exit":
        sys.exit(3)
    elif mode == "message":
        sys.exit("a message for the user")
    elif mode == "raise":
        def inner():
            raise ValueError("bad value")
        inner()
    elif mode == "sigint":
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
    elif mode == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "thread":
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
    """
)


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("probe")
    (folder / "probe.py").write_text(PROBE)
    (folder / "lib").mkdir()
    (folder / "lib" / "probe_helper.py").write_text("VALUE = 42\n")
    return folder / "probe.py"


MODES = ["exit", "message", "raise", "sigint", "sigkill", "thread", "plain"]


def test_every_ending_gives_the_interpreters_status_and_output(probe: Path) -> None:
    env = {"PYTHONPATH": str(probe.parent / "lib"), "PYTHONUNBUFFERED": "1"}
    fresh = run_commands(
        [[sys.executable, str(probe), mode] for mode in MODES], timeout=60, env=env
    )
    forked = run_scripts([Script(probe, (mode,)) for mode in MODES], timeout=60, env=env)
    for mode, (code, output), (want_code, want_output) in zip(MODES, forked, fresh, strict=True):
        assert code == want_code, (mode, output, want_output)
        assert output == want_output, mode
    assert forked[MODES.index("raise")][1].count("File ") == 2  # <module> and inner() only
    assert forked[MODES.index("sigint")][0] == -2  # the interpreter dies by the signal


def test_argv_paths_and_environment_are_the_interpreters(
    probe: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NNH_FORKED_DROPPED", "set after the forkserver started")
    monkeypatch.delenv("NNH_FORKED_DROPPED")  # gone from the caller: gone from the script
    env = {"PYTHONPATH": str(probe.parent / "lib")}
    script = Script(probe, ("facts",), env={"ADDED": "yes"})
    code, output = run_script(script, timeout=60, env=env, cwd=tmp_path)
    assert code == 0, output
    facts = json.loads(output.splitlines()[2])
    assert facts == {
        "argv": [str(probe), "facts"],
        "file": str(probe),
        "name": "__main__",
        "path0": str(probe.parent),
        "cwd": str(tmp_path),
        "added": "yes",
        "dropped": None,
        "helper": 42,
        "start_method": None,  # not the forkserver's: the script's own workers start as its would
    }


def test_a_module_runs_as_python_dash_m(tmp_path: Path) -> None:
    code, output = run_script(Script(module="nn_handler.cli", args=("--help",)), timeout=60)
    want_code, want_output = run_commands(
        [[sys.executable, "-m", "nn_handler.cli", "--help"]], timeout=60
    )[0]
    assert (code, output) == (want_code, want_output)


def test_a_hang_is_killed_at_the_bound_with_the_output_so_far(tmp_path: Path) -> None:
    (tmp_path / "hang.py").write_text(
        "print('started', flush=True)\nimport time\ntime.sleep(600)\n"
    )
    with pytest.raises(GroupRunError, match=r"(?s)passed \d+s and were killed.*started"):
        run_script(Script(tmp_path / "hang.py"), timeout=2)


def test_the_streams_apart_are_subprocess_runs(probe: Path) -> None:
    import subprocess

    for mode in ("raise", "message"):
        fresh = subprocess.run(
            [sys.executable, str(probe), mode], capture_output=True, text=True, timeout=60
        )
        forked = run_script_split(Script(probe, (mode,)), timeout=60)
        assert forked == (fresh.returncode, fresh.stdout, fresh.stderr), mode
        assert forked[1] == "out\natexit ran\n" and forked[2].startswith("err\n"), forked
