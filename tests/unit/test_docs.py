"""The documentation site builds with warnings as errors (mkdocs --strict): every page in the
nav exists, every internal link resolves, and the API reference renders every module."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import yaml
from pydantic import BaseModel

from nn_handler import HandlerConfig
from nn_handler.config import CheckpointConfig, EarlyStoppingConfig
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
    raw = [
        str(html.relative_to(tmp_path))
        for html in (tmp_path / "site").rglob("*.html")
        if ROLES.search(html.read_text())
    ]
    assert not raw, f"pages with raw Sphinx roles: {raw}"


def test_every_docs_page_is_in_the_nav() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")]
    assert pages and all(page in nav for page in pages), [p for p in pages if p not in nav]


ROLES = re.compile(r":(meth|class|func|attr|data|mod|exc|obj|ref):`")


def test_docstrings_and_docs_have_no_sphinx_roles() -> None:
    """mkdocstrings renders docstrings as Markdown: a :meth:`x` role would show as raw text."""
    roles = ROLES
    sources = [*ROOT.joinpath("nn_handler").rglob("*.py"), *ROOT.joinpath("docs").rglob("*.md")]
    found = [
        f"{p.relative_to(ROOT)}: {m.group(0)}"
        for p in sources
        for m in roles.finditer(p.read_text())
    ]
    assert not found, found


SECTIONS: dict[str, type[BaseModel]] = {
    name: field.annotation  # type: ignore[misc]
    for name, field in HandlerConfig.model_fields.items()
}
CONFIGS: dict[str, type[BaseModel]] = {
    cls.__name__: cls for cls in (HandlerConfig, *SECTIONS.values(), EarlyStoppingConfig)
}
#: Deliberate misspellings: the docs show the error they give.
SHOWN_AS_ERRORS = {"trainr"}


def _docs() -> list[tuple[str, str]]:
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
    return [(str(page.relative_to(ROOT)), page.read_text()) for page in pages]


def _unknown(model: type[BaseModel], names: list[str]) -> list[str]:
    return [n for n in names if n not in model.model_fields and n not in SHOWN_AS_ERRORS]


def test_every_config_field_named_in_the_docs_exists() -> None:
    problems: list[str] = []
    checked = 0
    for page, text in _docs():
        # XxxConfig(field=..., other=...); not.Ours(...) (ray.train.CheckpointConfig) is not ours
        for call in re.finditer(r"(?<![.\w])([A-Z]\w*Config)\(([^()]*)\)", text):
            model = CONFIGS.get(call.group(1))
            names = re.findall(r"(?:^|[,(\s])(\w+)=", call.group(2))
            if model is not None:
                checked += len(names)
                problems += [f"{page}: {call.group(0)}: {n}" for n in _unknown(model, names)]
        # `section: {field: ..., other: ...}` and "section": {"field": ...}
        for inline in re.finditer(r"\b\"?(\w+)\"?: \{([^{}]*)\}", text):
            model = SECTIONS.get(inline.group(1))
            if model is None and inline.group(1) == "early_stopping":
                model = EarlyStoppingConfig
            names = re.findall(r"\"?(\w+)\"?:", inline.group(2))
            if model is not None:
                checked += len(names)
                problems += [f"{page}: {inline.group(0)}: {n}" for n in _unknown(model, names)]
        # `section.field` (a whole code span), for sections that are not also object names
        for dotted in re.finditer(r"`(checkpoint|ema|precision|logging|distributed)\.(\w+)`", text):
            checked += 1
            problems += [
                f"{page}: {dotted.group(0)}"
                for n in _unknown(SECTIONS[dotted.group(1)], [dotted.group(2)])
            ]
        # YAML config blocks validate as a whole
        for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.S):
            data = yaml.safe_load(block)
            if isinstance(data, dict) and set(data) <= set(SECTIONS):
                checked += 1
                HandlerConfig.from_dict(data, source=f"{page} yaml block")
    # the field tables of docs/checkpoints.md
    table = (ROOT / "docs" / "checkpoints.md").read_text().split("| field | default |")[1]
    for row in re.findall(r"^\| ([^|]+) \|", table.split("\n\n")[0], flags=re.M)[1:]:
        names = re.findall(r"`(\w+)`", row)
        checked += len(names)
        problems += [f"checkpoints.md table: {n}" for n in _unknown(CheckpointConfig, names)]
    assert checked > 40, checked  # the patterns still find the docs' fields
    assert not problems, problems


def test_the_observability_guides_python_runs_as_written(tmp_path: Path) -> None:
    text = (ROOT / "docs" / "observability.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2  # the monitor, then a tracker of your own (it reuses the first)
    script = tmp_path / "guide.py"
    script.write_text("\n".join(blocks))
    code, output = run_command([sys.executable, str(script)], timeout=180, cwd=tmp_path)
    assert code == 0, output
    found = re.search(
        r"([\d.e+]+) FLOPs per sample, ([\d.e+-]+) TFLOP/s, ([\d.e+]+) pixels/s", output
    )
    assert found is not None and float(found.group(1)) > 1e6, output  # the CNN: ~2 MFLOPs
    assert "step 20 ['train_loss_step']" in output and "'step_ms'" in output, output
    assert "step 10 ['grad_norm']\nstep 20 ['train_loss_step']\nstep 20 ['grad_norm']" in output
