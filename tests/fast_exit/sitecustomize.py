"""Imported by every Python interpreter the test suite starts (tests/interpreters.py puts this
folder first on their PYTHONPATH): when the interpreter exits, the garbage collector's last
collections skip what it holds by then (``gc.freeze`` as the last exit handler).

Exiting an interpreter that imported torch and nn_handler otherwise spends 0.6-0.9 s of CPU
walking their 200,000 objects several times while the modules are torn down; the suite
starts about 300 such interpreters (torchrun agents and ranks, examples, the demo, Ray's
workers, the benchmarks' scripts). Nothing a test checks changes: stdout and stderr are still
flushed, every exit handler still runs (before this one), and objects are still freed by
their reference counts; only cyclic garbage left at the very end is not collected, as
``os._exit`` would leave it.
"""

import atexit
import gc

atexit.register(gc.freeze)
