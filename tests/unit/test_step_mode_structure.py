"""The step modes as one part (issue 70), pinned: the Trainer holds one StepMode and calls
each lifecycle point without asking which (at most 2 mode branches in trainer.py, fault
tolerance named there at most once); the frames from ``NNHandler.train`` to the backward of
the reproducible and fault-tolerant steps; the training layer's imports point down; no file in
nn_handler is over 450 lines; the Trainer's public names stay at most 40."""

from __future__ import annotations

import ast
import inspect
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import nn_handler
from nn_handler import NNHandler
from nn_handler.training.facade import TrainerFacade
from nn_handler.training.trainer import Trainer
from tests.training_helpers import mlp, regression_data, sgd

PACKAGE = Path(nn_handler.__file__).parent
TRAINER = PACKAGE / "training" / "trainer.py"
#: Names whose test in an ``if`` makes it a branch on the step mode.
MODE_NAMES = {"mode", "reproducible", "fault_tolerance", "whole_steps", "ReproducibleMode"}
LONGEST = 450


def _mode_branches(source: str) -> list[int]:
    """The lines of the ``if``s, conditional expressions and comprehension filters whose test
    names the step mode (``self.mode...``, ``config.reproducible``, ...)."""
    tests: list[tuple[int, ast.expr]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.If, ast.IfExp, ast.While)):
            tests.append((node.lineno, node.test))
        elif isinstance(node, ast.comprehension):
            tests += [(cond.lineno, cond) for cond in node.ifs]
    lines = []
    for line, test in tests:
        names = {n.attr for n in ast.walk(test) if isinstance(n, ast.Attribute)}
        names |= {n.id for n in ast.walk(test) if isinstance(n, ast.Name)}
        if names & MODE_NAMES:
            lines.append(line)
    return lines


def test_the_branch_count_sees_each_spelling() -> None:
    source = (
        "if self.mode.whole_steps:\n    pass\n"
        "x = a if self.reproducible is None else b\n"
        "y = [p for p in ps if config.fault_tolerance]\n"
        "if self.config.epochs:\n    pass\n"
    )
    assert _mode_branches(source) == [1, 3, 4]


def test_the_trainer_branches_on_its_mode_at_most_twice() -> None:
    branches = _mode_branches(TRAINER.read_text())
    assert len(branches) <= 2, f"trainer.py branches on the step mode at lines {branches}"


def test_fault_tolerance_is_named_in_the_trainer_at_most_once() -> None:
    tree = ast.parse(TRAINER.read_text())
    named = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Attribute)
             and "fault_tolerance" in n.attr]  # fmt: skip
    named += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Name)
              and "fault_tolerance" in n.id]  # fmt: skip
    named += [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              and "fault_tolerance" in (n.module or "")]  # fmt: skip
    assert len(named) <= 1, named


def test_no_file_in_nn_handler_is_over_450_lines() -> None:
    long = {
        path.relative_to(PACKAGE).as_posix(): n
        for path in sorted(PACKAGE.rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > LONGEST
    }
    assert long == {}, f"over {LONGEST} lines (split by what each part does): {long}"


def test_the_trainers_public_names_are_at_most_40() -> None:
    """Its methods and properties, the facade's included (its parts, the attributes
    docs/training.md lists, are pinned by test_trainer_structure)."""
    names = {n for n, v in inspect.getmembers(Trainer) if not n.startswith("_")
             and (inspect.isfunction(v) or isinstance(v, property))}  # fmt: skip
    names |= {n for n, v in vars(TrainerFacade).items() if not n.startswith("_")
              and (inspect.isfunction(v) or isinstance(v, property))}  # fmt: skip
    assert "mode" in TrainerFacade.__annotations__ and "reproducible" not in names
    assert len(names) <= 40, sorted(names)


# ----------------------------------------------------------------- imports point down
def _training_imports() -> dict[str, set[str]]:
    """Each module of nn_handler.training and the nn_handler modules it imports (every import,
    TYPE_CHECKING's too)."""
    found: dict[str, set[str]] = {}
    for path in sorted((PACKAGE / "training").rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        imported: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module)
            elif isinstance(node, ast.Import):
                imported |= {a.name for a in node.names}
        found[name] = {m for m in imported if m.startswith("nn_handler")}
    return found


#: What sits above what in nn_handler.training: a module may import only what is not above it.
#: The loop (trainer.py) on top, its surface (facade.py) and the choice of a step mode under it;
#: the two modes beside each other, on the common base; nothing of training above the package.
ABOVE = {
    "nn_handler.training.trainer": "the loop",
    "nn_handler.training.facade": "the loop's surface",
    "nn_handler.training.modes.choice": "the choice of a step mode",
}
HIGHER_LAYERS = ("nn_handler.handler", "nn_handler.cli", "nn_handler.launch", "nn_handler.demo")


def _upward(graph: dict[str, set[str]]) -> list[str]:
    """Each import in ``graph`` that goes up a layer or across between the two modes."""
    found = []
    modes = ("nn_handler.training.reproducible", "nn_handler.training.fault_tolerance")
    for module, imported in graph.items():
        for target in sorted(imported):
            if target in ABOVE and not _may_import(module, target):
                found.append(f"{module} imports {target} ({ABOVE[target]})")
            if target.startswith(HIGHER_LAYERS):
                found.append(f"{module} imports {target} (a layer above training)")
            mine = [m for m in modes if module.startswith(m)]
            theirs = [m for m in modes if target.startswith(m)]
            if mine and theirs and mine != theirs:
                found.append(f"{module} imports {target} (the modes sit beside each other)")
            if module == "nn_handler.training.modes.base" and theirs:
                found.append(f"{module} imports {target} (the base knows no mode)")
    return found


def test_the_training_layers_imports_point_down() -> None:
    assert _upward(_training_imports()) == []


def _may_import(module: str, target: str) -> bool:
    allowed = {
        "nn_handler.training.trainer": set(ABOVE) - {"nn_handler.training.trainer"},
        "nn_handler.training": set(ABOVE),  # the package's own names
    }
    return target in allowed.get(module, set())


def test_the_import_check_catches_an_upward_import() -> None:
    graph = _training_imports()
    graph["nn_handler.training.fault_tolerance.steps"].add("nn_handler.training.reproducible")
    graph["nn_handler.training.epoch"].add("nn_handler.training.trainer")
    graph["nn_handler.training.modes.base"].add("nn_handler.training.fault_tolerance.mode")
    assert sorted(_upward(graph)) == [
        "nn_handler.training.epoch imports nn_handler.training.trainer (the loop)",
        "nn_handler.training.fault_tolerance.steps imports nn_handler.training.reproducible "
        "(the modes sit beside each other)",
        "nn_handler.training.modes.base imports nn_handler.training.fault_tolerance.mode "
        "(the base knows no mode)",
    ]


def test_the_training_layer_has_no_import_cycle() -> None:
    graph = _training_imports()
    modules = set(graph)
    edges = {m: {t for t in graph[m] if t in modules and t != m and not m.startswith(t + ".")}
             for m in modules}  # fmt: skip
    state: dict[str, int] = {}

    def cycle_from(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(edges[node]):
            if state.get(nxt) == 1:
                return [*path, node, nxt]
            if nxt not in state and (found := cycle_from(nxt, [*path, node])):
                return found
        state[node] = 2
        return None

    for module in sorted(modules):
        if module not in state:
            assert cycle_from(module, []) is None


# ----------------------------------------------------------------- frames to the backward
def _backward_stack(config: dict[str, Any]) -> list[str]:
    """The nn_handler frames on the stack when autograd reaches the model's first weight."""
    seen: list[list[str]] = []
    with NNHandler(mlp(), sgd, nn.CrossEntropyLoss(), config=config) as handler:
        weight = next(handler.trainer.module.parameters())

        def record(grad: torch.Tensor) -> torch.Tensor:
            if not seen:
                frames = traceback.extract_stack()
                seen.append([f"{Path(f.filename).name}:{f.name}" for f in frames
                             if str(PACKAGE) in f.filename])  # fmt: skip
            return grad

        weight.register_hook(record)
        handler.train(regression_data(n=8), epochs=1)
    return seen[0]


REPRODUCIBLE = {"global_batch_size": 4, "micro_batch_size": 2}
#: From NNHandler.train to the mode's step: the same five frames as the normal step's path.
TO_THE_MODE = ["handler.py:train", "trainer.py:fit", "trainer.py:train_epoch",
               "trainer.py:run_step", "mode.py:step"]  # fmt: skip
#: The reproducible mode's step to the backward of one micro-batch.
EXACT = ["exact_step.py:run", "exact_step.py:_pass", "mode.py:forward_backward"]


def test_the_reproducible_steps_frames_are_pinned() -> None:
    config = {"trainer": {"progress_bar": False, "reproducible": REPRODUCIBLE}}
    assert _backward_stack(config) == [*TO_THE_MODE, *EXACT]


@pytest.mark.timeout(180)
def test_the_fault_tolerant_steps_frames_are_pinned() -> None:
    """A member wraps the reproducible mode: its step, its attempt loop, then the inner mode's
    step (a partial: no lambda frame) and the same exact step."""
    pytest.importorskip("torchft")
    from nn_handler.training.fault_tolerance import Lighthouse

    with Lighthouse(min_members=1) as lighthouse:
        members = {"lighthouse": lighthouse.address, "min_members": 1, "timeout_s": 30}
        config = {"trainer": {"progress_bar": False, "reproducible": REPRODUCIBLE,
                              "fault_tolerance": members}}  # fmt: skip
        stack = _backward_stack(config)
    assert stack == [*TO_THE_MODE, "steps.py:step", "steps.py:_committed", "mode.py:step",
                     *EXACT]  # fmt: skip
