"""History: one record per epoch (train loss, validation metrics, learning rate, timing)."""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nn_handler.errors import ConfigError

Record = dict[str, float]
#: The key of an epoch's record that max_steps ended inside it: the batches it trained.
PARTIAL = "partial_batches"


class History:
    """Per-epoch records. Losses and metrics are reduced values, the same on every rank; the
    timing fields (``epoch_time``, ``samples_per_sec``) are each rank's own.

    ``history["val_loss"]`` is the list of one key over epochs (NaN where an epoch lacks it);
    ``history.last`` the latest record. Save with ``to_json`` / ``to_csv`` and draw
    the curves with ``plot`` (needs matplotlib: ``pip install nn_handler[plot]``).
    """

    def __init__(self, records: list[Record] | None = None) -> None:
        self.records: list[Record] = [dict(r) for r in records or []]

    def append(self, record: Record) -> None:
        """Add an epoch's record. A record replaces the partial one of the same epoch (a fit
        that max_steps ended inside it: ``partial_batches`` set) when it completes it."""
        last = self.records[-1] if self.records else {}
        if PARTIAL in last and last.get("epoch") == record.get("epoch"):
            self.records[-1] = dict(record)
            return
        self.records.append(dict(record))

    @property
    def last(self) -> Record:
        if not self.records:
            raise ConfigError("History is empty: no epoch has finished yet.")
        return self.records[-1]

    def keys(self) -> list[str]:
        seen: dict[str, None] = {}
        for record in self.records:
            seen.update(dict.fromkeys(record))
        return list(seen)

    def __getitem__(self, key: str) -> list[float]:
        if key not in self.keys():
            raise KeyError(f"History has no {key!r}; it has {self.keys()}.")
        return [r.get(key, math.nan) for r in self.records]

    def __len__(self) -> int:
        return len(self.records)

    def __iter__(self) -> Iterator[Record]:
        return iter(self.records)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, History) and self.records == other.records

    def __repr__(self) -> str:
        return f"History({len(self.records)} epochs, keys={self.keys()})"

    # ----------------------------------------------------------------- persistence
    def state_dict(self) -> dict[str, Any]:
        return {"records": [dict(r) for r in self.records]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.records = [dict(r) for r in state["records"]]

    def to_json(self, path: str | Path) -> Path:
        target = Path(path)
        target.write_text(json.dumps(self.records, indent=2, allow_nan=True) + "\n")
        return target

    @classmethod
    def from_json(cls, path: str | Path) -> History:
        return cls(json.loads(Path(path).read_text()))

    def to_csv(self, path: str | Path) -> Path:
        target = Path(path)
        with target.open("w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=self.keys(), restval="")
            writer.writeheader()
            writer.writerows(self.records)
        return target

    def figure(self) -> Any:
        """A matplotlib Figure of the loss curves and of every other validation metric (the
        caller closes it: ``matplotlib.pyplot.close(figure)``)."""
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError as error:
            raise ConfigError(
                "History.plot needs matplotlib: pip install 'nn_handler[plot]'."
            ) from error
        epochs = self["epoch"] if "epoch" in self.keys() else list(range(1, len(self) + 1))
        losses = [k for k in self.keys() if k.endswith("loss")]
        others = [k for k in self.keys() if k.startswith("val_") and k not in losses]
        panels = 2 if others else 1
        figure, axes = plt.subplots(1, panels, figsize=(6 * panels, 4), squeeze=False)
        for row, (keys, title) in enumerate([(losses, "loss"), (others, "metrics")][:panels]):
            axis = axes[0][row]
            for key in keys:
                axis.plot(epochs, self[key], marker="o", label=key)
            axis.set_xlabel("epoch")
            axis.set_title(title)
            axis.legend()
            axis.grid(alpha=0.3)
        figure.tight_layout()
        return figure

    def plot(self, path: str | Path) -> Path:
        """Write a PNG of the loss curves and of every other validation metric."""
        figure = self.figure()
        import matplotlib.pyplot as plt

        target = Path(path)
        figure.savefig(target, dpi=100)
        plt.close(figure)
        return target


__all__ = ["PARTIAL", "History", "Record"]
