"""``nn-handler plan``: a run's plan at any world size, from its config file and its model's
factory, printed as a table (or JSON); exit status 1 when the launch would refuse it."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from collections.abc import Callable
from typing import Any

from pydantic import ByteSize, TypeAdapter, ValidationError

from nn_handler.errors import ConfigError


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a positive integer")
    return value


def _bytes(text: str) -> int:
    try:
        return int(TypeAdapter(ByteSize).validate_python(text))
    except ValidationError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a size: give bytes or a unit, e.g. 80GiB or 512MB"
        ) from None


def add_plan_parser(commands: Any) -> None:
    """The ``plan`` command's arguments, on the CLI's subparsers."""
    plan = commands.add_parser(
        "plan",
        help="plan a run at any world size in this process: memory per rank, the data's "
        "deal, every refusal of the launch",
        description="Build the model on the meta device, resolve the strategy for --world "
        "ranks as the launch does, and report what one rank holds, how the data is dealt "
        "and every ConfigError the launch would raise. Exit status 1 when it would refuse.",
    )
    plan.add_argument("config", metavar="CONFIG", help="the run's config file (YAML or JSON)")
    plan.add_argument("--world", type=_positive, required=True, help="ranks in all")
    plan.add_argument(
        "--model",
        required=True,
        metavar="MODULE:FACTORY",
        help="a function returning the model (or the model and one batch's inputs), "
        "importable from the current folder, e.g. train:build_model",
    )
    plan.add_argument("--nodes", type=_positive, default=1, help="machines (default 1)")
    plan.add_argument("--device-memory", type=_bytes, help="one rank's memory, e.g. 80GiB")
    plan.add_argument("--resume-world", type=_positive, help="plan a resume at this size")
    plan.add_argument("--samples", type=_positive, help="the training set's size")
    plan.add_argument(
        "--optimizer-slots",
        type=float,
        default=2.0,
        help="optimizer state elements per parameter element (AdamW 2, SGD with momentum 1)",
    )
    plan.add_argument("--device", choices=["cuda", "cpu"], default="cuda", help="default cuda")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")


def model_factory(spec: str) -> Callable[[], Any]:
    """The function ``module:factory`` names, imported with the current folder on the path.
    ConfigError naming what is missing."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"--model {spec!r}: give MODULE:FACTORY, e.g. train:build_model.")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"--model {spec!r}: cannot import {module_name} ({error}).") from None
    factory = getattr(module, attribute, None)
    if not callable(factory):
        raise ConfigError(f"--model {spec!r}: {module_name} has no function {attribute}.")
    return factory  # type: ignore[no-any-return]


def run_plan_command(args: argparse.Namespace) -> int:
    """Print the plan; 0 if the launch would take it, 1 if it would refuse, 2 for a command
    this cannot plan (its config file or model factory missing)."""
    from nn_handler.config.handler import HandlerConfig
    from nn_handler.planning.report import plan_json, plan_table
    from nn_handler.planning.run_plan import plan_run

    try:
        factory = model_factory(args.model)
        try:
            config: Any = HandlerConfig.from_file(args.config)
        except ConfigError as error:
            if not str(error).startswith("invalid "):
                raise
            config = _raw(args.config)  # the plan lists what is invalid, with the rest
        plan = plan_run(
            config,
            args.world,
            factory,
            nodes=args.nodes,
            device_memory=args.device_memory,
            resume_world=args.resume_world,
            samples=args.samples,
            device_type=args.device,
            optimizer_slots=args.optimizer_slots,
        )
    except ConfigError as error:
        print(f"nn-handler plan: {error}", file=sys.stderr)
        return 2
    print(json.dumps(plan_json(plan), indent=2) if args.json else plan_table(plan))
    return 1 if plan.refusals else 0


def _raw(path: str) -> dict[str, Any]:
    """The config file's mapping, unvalidated (plan_run validates it, listing every error)."""
    import yaml

    with open(path) as file:
        data = yaml.safe_load(file)
    return data if isinstance(data, dict) else {}


__all__ = ["add_plan_parser", "model_factory", "run_plan_command"]
