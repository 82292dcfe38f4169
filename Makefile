# Two commands for a newcomer: `make demo` and `make test`. Both create .venv when missing and
# install through constraints.txt, which pins torch to the CPU wheel already on the machine.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed-dev
BENCH_STAMP := $(VENV)/.installed-bench
PIP_INSTALL := $(BIN)/python -m pip install --quiet -c constraints.txt
# The packages themselves go in through uv (pinned in constraints.txt, installed by pip): the
# same versions pip resolves, downloaded, unpacked and byte-compiled on every core, about 30 s
# where pip took about 110 (tests/README.md). uv reads no pip configuration, so it is handed
# pip's find-links (PIP_FIND_LINKS, else pip's own setting): the folder where the CPU wheel of
# torch lies on the development machines.
UV_INSTALL = links="$${PIP_FIND_LINKS:-$$($(BIN)/python -m pip config get global.find-links 2>/dev/null)}"; \
	$(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt --compile-bytecode \
	$$(for link in $$links; do printf -- '--find-links %s ' "$$link"; done)

.PHONY: demo docs test test-fast lint typecheck install bench bench-quick clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(BIN)/python pyproject.toml constraints.txt
	$(PIP_INSTALL) uv
	$(UV_INSTALL) -e ".[dev]"
	touch $(STAMP)

install: $(STAMP)

# The optional peers the training-step benchmark compares against (Lightning Fabric, Accelerate).
$(BENCH_STAMP): $(STAMP)
	$(UV_INSTALL) -e ".[dev,bench]"
	touch $(BENCH_STAMP)

# Every benchmark in full mode (10-15 minutes on 2 cores): benchmarks/results/*.json and
# benchmarks/RESULTS.md. bench-quick is the smoke run (about a minute), into .bench-quick/.
bench: $(BENCH_STAMP)
	$(BIN)/python benchmarks/run_all.py

bench-quick: $(BENCH_STAMP)
	$(BIN)/python benchmarks/run_all.py --quick --results .bench-quick --report .bench-quick/RESULTS.md

demo: $(STAMP)
	$(BIN)/nn-handler demo

docs: $(STAMP)
	$(BIN)/mkdocs build --strict

lint: $(STAMP)
	$(BIN)/ruff check nn_handler tests examples benchmarks
	$(BIN)/ruff format --check nn_handler tests examples benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# The edit loop: lint, types and the in-process tests (no second process), about 2 minutes.
test-fast: lint typecheck
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 2 --dist loadfile tests/unit tests/property

# The checkout's own modules byte-compiled (only those changed since the last run): Python reads
# a .pyc even where PYTHONDONTWRITEBYTECODE forbids writing one, and every interpreter the suite
# starts (about 300: torchrun, examples, Ray workers) would otherwise compile nn_handler from
# source, 0.3 s of CPU each. The installed packages were compiled by the install.
COMPILE = $(BIN)/python -m compileall -q -j 0 nn_handler tests examples benchmarks

# Every test in one pytest session, three workers on the two cores (a worker waiting on a
# subprocess or a deadline leaves its core to the others: 6% idle with two workers, 2% with
# three), with ruff and mypy alongside (one core for about 30 s, which they left idle when they
# ran first; the tests' output comes live, theirs after it). A file's tests stay on one worker
# (its module fixtures, one process group serving many checks, run once), files in collection
# order: the longest files first (tests/conftest.py's LONGEST_FIRST), then the folders, the
# heaviest first, so that the light in-process tests fill the end (tests/README.md). Every part runs even when another fails; the exit status says whether any
# failed.
test: $(STAMP)
	@status=0; checks=$$(mktemp); \
	echo "make test: ruff and mypy run alongside the tests; their output follows the tests'"; \
	( part=0; $(MAKE) --no-print-directory lint || part=1; \
	  $(MAKE) --no-print-directory typecheck || part=1; exit $$part ) > $$checks 2>&1 & \
	checks_pid=$$!; \
	$(COMPILE) || status=1; \
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -n 3 --dist loadfile --no-loadscope-reorder \
		tests/launched tests/distributed tests/unit tests/property || status=1; \
	wait $$checks_pid || status=1; \
	cat $$checks; rm -f $$checks; \
	if [ $$status -ne 0 ]; then echo "make test: some part failed (see above)"; fi; \
	exit $$status

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis site .bench-quick
