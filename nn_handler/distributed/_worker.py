"""Child-process entry point for the process runner: ``python -m nn_handler.distributed._worker
WORKDIR INDEX``.

Reads the task from WORKDIR/payload, calls ``task(INDEX)``, and writes the result (or the error's
traceback and, when picklable, the exception) to WORKDIR. On SIGUSR1 it dumps every thread's
stack to WORKDIR/INDEX.stacks, so a parent that has to kill a hung worker can say where it was.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import sys
import traceback
from pathlib import Path
from typing import IO

_STACKS: IO[str] | None = None  # kept open for faulthandler


def _write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    global _STACKS
    workdir, index = Path(argv[1]), int(argv[2])
    _STACKS = open(workdir / f"{index}.stacks", "w")  # noqa: SIM115 - must outlive this frame
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=_STACKS, all_threads=True)
    try:
        envelope = pickle.loads((workdir / "payload").read_bytes())
        for entry in reversed(envelope["sys_path"]):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        import cloudpickle

        task = cloudpickle.loads(envelope["task"])
        result = task(index)
        _write_atomically(workdir / f"{index}.result", cloudpickle.dumps(result))
        return 0
    except BaseException as error:
        (workdir / f"{index}.error").write_text(traceback.format_exc())
        try:
            import cloudpickle

            _write_atomically(workdir / f"{index}.exception", cloudpickle.dumps(error))
        except Exception:
            pass  # the traceback text above is what matters
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    sys.exit(main(sys.argv))
