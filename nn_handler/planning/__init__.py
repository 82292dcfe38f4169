"""Plans of runs not launched yet (``nn-handler plan``): memory per rank, the data's deal, one
step's collectives, the checkpoint and every refusal of the launch, for any world size, in one
process on the meta device. The
names load when first asked for (the CLI imports ``command`` alone, without torch)."""

from __future__ import annotations

from typing import Any

_NAMES = ("DataPlan", "Refusal", "RunPlan", "plan_run")


def __getattr__(name: str) -> Any:
    if name not in _NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from nn_handler.planning import run_plan

    return getattr(run_plan, name)


__all__ = ["DataPlan", "Refusal", "RunPlan", "plan_run"]
