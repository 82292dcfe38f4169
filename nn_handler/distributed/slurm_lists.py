"""SLURM's compressed lists, expanded: hostlists (``node[01-03,07]``) and tasks per node
(``2(x3),1``). Pure functions; malformed input is a ConfigError naming the variable."""

from __future__ import annotations

import re

from nn_handler.errors import ConfigError


def is_ascii_int(text: str) -> bool:
    """ASCII decimal digits only (str.isdigit() accepts '¹', which int() does not)."""
    return text.isascii() and text.isdecimal()


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def expand_slurm_tasks_per_node(value: str) -> list[int]:
    """Expand SLURM's compressed tasks-per-node list: ``"2(x3),1"`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for item in value.split(","):
        match = _TASKS_ITEM.match(item.strip())
        if match is None:
            raise ConfigError(
                f"SLURM_TASKS_PER_NODE={value!r} is not of the form '2(x3),1' (item {item!r})."
            )
        counts.extend([int(match.group(1))] * int(match.group(2) or 1))
    return counts


def _split_top_level(text: str, source: str) -> list[str]:
    items, depth, start = [], 0, 0
    for index, char in enumerate(text):
        if char == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"{source}={text!r}: nested '[' at position {index}.")
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{source}={text!r}: unmatched ']' at position {index}.")
        elif char == "," and depth == 0:
            items.append(text[start:index])
            start = index + 1
    if depth:
        raise ConfigError(f"{source}={text!r}: unclosed '['.")
    items.append(text[start:])
    return items


def _expand_ranges(body: str, nodelist: str) -> list[str]:
    values: list[str] = []
    for part in body.split(","):
        lo, sep, hi = part.strip().partition("-")
        if not is_ascii_int(lo) or (sep and not is_ascii_int(hi)):
            raise ConfigError(
                f"SLURM_JOB_NODELIST={nodelist!r}: range {part!r} is not 'N' or 'N-M'."
            )
        if not sep:
            values.append(lo)
            continue
        if int(hi) < int(lo):
            raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r}: range {part!r} runs backwards.")
        width = len(lo)
        values.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return values


def expand_slurm_nodelist(nodelist: str) -> list[str]:
    """Expand a SLURM hostlist: ``"node[01-03,07],gpu5"`` -> ``[node01, node02, node03, node07,
    gpu5]``. Several bracket groups in one name (``"r[1-2]n[1-2]"``) expand as a product.
    Raises ``ConfigError`` on malformed input."""
    hosts: list[str] = []
    for item in _split_top_level(nodelist.strip(), "SLURM_JOB_NODELIST"):
        if not item:
            raise ConfigError(f"SLURM_JOB_NODELIST={nodelist!r} has an empty host name.")
        expanded = [""]
        for literal, body in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", item):
            if not literal and not body:
                continue
            choices = _expand_ranges(body, nodelist) if body else [""]
            expanded = [prefix + literal + choice for prefix in expanded for choice in choices]
        hosts.extend(expanded)
    return hosts


__all__ = ["expand_slurm_nodelist", "expand_slurm_tasks_per_node", "is_ascii_int"]
