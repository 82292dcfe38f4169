"""What torch's weights-only unpickler refused, said without its advice to load unrestricted.
A leaf module: the file loader (io.py) and the shard reader (safe_dcp.py) both use it."""

from __future__ import annotations


def weights_only_cause(error: BaseException) -> str:
    """What weights-only loading refused, in one line, without torch's advice to load the
    file unrestricted (which runs whatever it asks): its 'Unsupported ...' line, else the
    error's type."""
    for line in str(error).splitlines():
        if line.strip().startswith("Unsupported"):
            return line.strip()
    first = (str(error).strip().splitlines() or [""])[0]
    return type(error).__name__ if "weights_only" in first else first


__all__ = ["weights_only_cause"]
