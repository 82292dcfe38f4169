"""A RunPlan for people (a table, one line per item) and for programs (JSON)."""

from __future__ import annotations

from typing import Any

from nn_handler.planning.run_plan import RunPlan
from nn_handler.strategies.memory_plan import gib


def plan_json(plan: RunPlan) -> dict[str, Any]:
    """The plan as JSON-ready values (bytes as integers)."""
    memory = None
    if plan.memory is not None:
        memory = {
            "items": [
                {"name": name, "bytes": size, "how": how} for name, size, how in plan.memory.items
            ],
            "total": plan.memory.total,
            "largest": max(plan.memory.items, key=lambda item: item[1])[0],
        }
    data = None if plan.data is None else dict(vars(plan.data))
    return {
        "world": plan.world,
        "nodes": plan.nodes,
        "strategy": plan.strategy,
        "layout": plan.layout,
        "memory_per_rank": memory,
        "budget": plan.budget,
        "data": data,
        "collectives_per_step": None
        if plan.collectives is None
        else [vars(collective) for collective in plan.collectives],
        "checkpoint": None if plan.checkpoint is None else dict(vars(plan.checkpoint)),
        "refusals": [{"where": r.where, "message": r.message} for r in plan.refusals],
    }


def plan_table(plan: RunPlan) -> str:
    """The plan as text: the layout, memory per rank item by item (the largest marked), the
    data's deal, then every refusal (or that there is none)."""
    lines = [f"plan: {plan.world} rank(s) on {plan.nodes} machine(s), {plan.layout}"]
    if plan.memory is not None:
        largest = max(plan.memory.items, key=lambda item: item[1])[0]
        lines.append("memory per rank:")
        for name, size, how in plan.memory.items:
            mark = "  <- the largest" if name == largest else ""
            lines.append(f"  {name:<26} {gib(size):>11}  ({how}){mark}")
        budget = "no budget given" if plan.budget is None else f"of {gib(plan.budget)}"
        lines.append(f"  {'total':<26} {gib(plan.memory.total):>11}  ({budget})")
    if plan.data is not None:
        data = plan.data
        lines.append("data per step:")
        lines.append(
            f"  global batch {data.global_batch} samples; at most {data.per_rank} per rank"
        )
        if data.micro_batches is not None:
            lines.append(
                f"  {data.micro_batches} micro-batches; at most {data.micro_batches_per_rank} "
                f"per rank"
            )
        if data.steps_per_epoch is not None:
            lines.append(f"  {data.steps_per_epoch} optimizer steps per epoch")
        if data.resume is not None:
            lines.append(f"  {data.resume}")
    if plan.collectives is None:
        lines.append("collectives per step: not planned for this mode yet")
    elif plan.collectives:
        lines.append("collectives per optimizer step, per rank:")
        for c in plan.collectives:
            shown = f"{c.bytes} B" if c.bytes < 1024 else gib(c.bytes)
            lines.append(f"  {c.op:<15} over {c.group:<10} {c.count:>4} x {shown:>11}")
    if plan.checkpoint is not None:
        saved = plan.checkpoint
        lines.append(f"checkpoint ({saved.format}): {gib(saved.tensors)} of tensors")
        lines.append(f"  {saved.writers}; at most {gib(saved.most_per_rank)} a rank")
        if saved.resume is not None:
            lines.append(f"  resumed: {saved.resume}")
    if plan.refusals:
        lines.append(f"the launch would refuse it ({len(plan.refusals)}):")
        for refusal in plan.refusals:
            first, *rest = refusal.message.splitlines()
            lines.append(f"  {refusal.where}: {first}")
            lines.extend(f"    {line.strip()}" for line in rest if line.strip())
    else:
        lines.append("the launch would refuse nothing this plan checks")
    return "\n".join(lines)


__all__ = ["plan_json", "plan_table"]
