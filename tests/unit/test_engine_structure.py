"""The fault-tolerance package's boundaries (issue 70), by AST walks over the package: every
use of torchft, and of names torch keeps private, is in one module of it
(training/fault_tolerance/engine.py), each listed in docs/architecture.md; and it imports
nothing of the reproducible mode, beside which it sits."""

from __future__ import annotations

import ast
from pathlib import Path

import nn_handler

PACKAGE = Path(nn_handler.__file__).parent
ENGINE = "training/fault_tolerance/engine.py"
#: Outside the engine, and why: the process-group layer's stores (torch re-exports them from
#: torch.distributed only implicitly, which a type checker refuses).
ELSEWHERE = {"distributed/context.py": {"torch._C._distributed_c10d"}}
#: torchft's private attributes the engine relies on (module docstring; docs/architecture.md).
PRIVATE = {"_quorum_id", "ManagerServer", "configure"}


def uses(source: str) -> set[str]:
    """The torchft and torch._C modules ``source`` imports, and the private names it reads
    or writes as attributes."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name.startswith(("torchft", "torch._C"))}
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module.startswith(("torchft", "torch._C")):
                found.add(node.module)
        elif isinstance(node, ast.Attribute) and node.attr in PRIVATE:
            found.add(node.attr)
    return found


def test_the_walk_finds_each_spelling() -> None:
    source = (
        "import torchft.manager as m\nfrom torch._C._distributed_c10d import TCPStore\n"
        "from torchft import Manager\nx = manager._quorum_id\nm.ManagerServer = f\n"
        "group.configure = g\nimport torch\ny = self.configure_optimizers\n"
    )
    assert uses(source) == {
        "torchft.manager", "torch._C._distributed_c10d", "torchft", "_quorum_id",
        "ManagerServer", "configure",
    }  # fmt: skip


def test_torchft_and_torchs_private_names_are_used_in_the_engine_only() -> None:
    outside = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name == ENGINE:
            continue
        found = uses(path.read_text()) - ELSEWHERE.get(name, set())
        if found:
            outside[name] = sorted(found)
    assert outside == {}, f"only {ENGINE} may use these (or say why in ELSEWHERE): {outside}"
    engine = uses((PACKAGE / ENGINE).read_text())
    assert engine >= PRIVATE and "torchft._torchft" in engine, engine


def test_the_architecture_page_lists_what_the_engine_relies_on() -> None:
    page = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    relied = ["_quorum_id", "ManagerServer", "configure()", "torchft._torchft",
              "CheckpointTransport", "AllgatherOptions", "TCPStore", "engine.py"]  # fmt: skip
    assert [name for name in relied if name not in page] == []


def test_fault_tolerance_imports_nothing_of_the_reproducible_mode() -> None:
    """The members' steps run the mode's step through a Protocol (steps.SummedStep): the
    import that went up from fault_tolerance/ to reproducible/ is gone, and stays gone."""
    found = {}
    for path in sorted((PACKAGE / "training" / "fault_tolerance").rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
        upward = sorted(n for n in names if n.startswith("nn_handler.training.reproducible"))
        if upward:
            found[path.name] = upward
    assert found == {}, found
