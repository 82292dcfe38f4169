"""``nn-handler plan`` (nn_handler/planning/, issue 75's first parts): a 512-rank HSDP plan of
a 1.1-billion-parameter model in this process (meta device: nothing allocated), its memory per
rank counted from the model's own sizes, the data's deal at any world (property-tested), the
resume at another world, and the command as a user runs it (table, JSON, exit status, one
line for a mistake). That its refusals are the real launch's: tests/distributed/
test_plan_refusals.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from examples.plan.model import LanguageModel, language_model, language_model_only
from nn_handler.cli import main
from nn_handler.config.training import FsdpConfig
from nn_handler.planning import plan_run
from nn_handler.planning.report import plan_table
from nn_handler.strategies.blocks import blocks_of
from nn_handler.strategies.memory_plan import ModelSizes

EXAMPLE = Path(__file__).parents[2] / "examples" / "plan" / "hsdp_512.yaml"
MODEL = "examples.plan.model:language_model"
HSDP = {
    "precision": "bf16",
    "trainer": {
        "strategy": "fsdp",
        "fsdp": {"blocks": ["TransformerEncoderLayer"], "replicate": 8, "shard": 64},
        "reproducible": {"global_batch_size": 1024, "micro_batch_size": 2},
    },
}


def test_a_512_rank_hsdp_plan_of_a_billion_parameter_model_counts_one_shard_per_rank() -> None:
    plan = plan_run(HSDP, 512, language_model_only, nodes=64, samples=100_000, resume_world=256)
    assert plan.refusals == [] and plan.strategy == "fsdp"
    assert plan.layout == "fsdp (HSDP 8 x 64: replicate x shard)"
    with torch.device("meta"):
        model = LanguageModel()
    sizes = ModelSizes.of(
        model, blocks_of(model, FsdpConfig(blocks=["TransformerEncoderLayer"]), "")
    )
    assert sizes.parameters > 1_000_000_000 * 4  # float32 bytes of over a billion parameters
    assert plan.memory is not None
    items = {name: size for name, size, _ in plan.memory.items}
    assert items["parameters"] == sizes.parameters // 64 + sizes.buffers
    assert items["gradients"] == sizes.trainable // 64
    assert items["optimizer state"] == 2 * sizes.trainable // 64
    assert "activations" not in items  # the factory gave no inputs
    assert plan.data is not None
    assert (plan.data.micro_batches, plan.data.micro_batches_per_rank) == (512, 1)
    assert plan.data.steps_per_epoch == math.ceil(100_000 / 1024)
    assert plan.data.resume == (
        "resuming a checkpoint of this run (written by 512 ranks) with 256 ranks: the "
        "reproducible mode's steps do not depend on the world size, so the run continues "
        "bit-identical to an uninterrupted one; at most 2 micro-batches per rank"
    )
    same = plan_run(HSDP, 512, language_model_only, nodes=64, resume_world=512)
    assert same.data is not None and same.refusals == []
    assert same.data.resume == (
        "resuming at the same 512 ranks: the same run, exactly; at most 1 micro-batches per rank"
    )


def test_inputs_from_the_factory_add_the_activations_and_the_budget_names_the_largest() -> None:
    plan = plan_run(HSDP, 512, language_model, nodes=64, device_memory=8 * 2**30)
    assert plan.memory is not None
    items = {name: size for name, size, _ in plan.memory.items}
    assert items["activations"] > 0 and items["validation"] > 0
    [refusal] = plan.refusals
    assert refusal.where == "memory"
    assert "(--device-memory); the largest item is activations" in refusal.message
    assert "What would fit:" in refusal.message


@settings(max_examples=60, deadline=None)
@given(
    micro=st.integers(1, 8),
    micro_batches=st.integers(1, 64),
    world=st.integers(1, 128),
    sharded=st.booleans(),
)
def test_the_deal_of_micro_batches_at_any_world(
    micro: int, micro_batches: int, world: int, sharded: bool
) -> None:
    """At most ceil(M / W) micro-batches per rank, which cover the step; a sharded model with
    fewer micro-batches than ranks is refused (each rank must run one), a replicated one is
    not (a rank may idle)."""
    trainer = {
        "strategy": "fsdp" if sharded else "auto",
        "reproducible": {"global_batch_size": micro * micro_batches, "micro_batch_size": micro},
    }
    plan = plan_run({"trainer": trainer}, world, lambda: torch.nn.Linear(4, 4), device_type="cpu")
    assert plan.data is not None and plan.data.micro_batches_per_rank is not None
    assert plan.data.micro_batches_per_rank * world >= micro_batches
    assert (plan.data.micro_batches_per_rank - 1) * world < micro_batches
    assert plan.data.per_rank == plan.data.micro_batches_per_rank * micro
    refused = any(r.where == "trainer.reproducible" for r in plan.refusals)
    assert refused == (sharded and micro_batches < world)


def test_nodes_must_divide_the_world_and_sizes_must_be_positive() -> None:
    plan = plan_run({}, 10, lambda: torch.nn.Linear(2, 2), nodes=4)
    assert [r.where for r in plan.refusals] == ["launch"]
    assert "nodes must divide the world" in plan.refusals[0].message
    from nn_handler.errors import ConfigError

    with pytest.raises(ConfigError, match="world=0"):
        plan_run({}, 0, lambda: torch.nn.Linear(2, 2))


def test_the_command_prints_the_table_and_exits_0_or_1(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    args = ["plan", str(EXAMPLE), "--world", "512", "--nodes", "64", "--model", MODEL]
    assert main([*args, "--device-memory", "80GiB", "--samples", "1000000"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("plan: 512 rank(s) on 64 machine(s), fsdp (HSDP 8 x 64")
    assert "<- the largest" in out and "of 80.00 GiB" in out
    assert "977 optimizer steps per epoch" in out
    assert out.rstrip().endswith("the launch would refuse nothing this plan checks")
    assert main([*args, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["world"] == 512 and report["refusals"] == []
    assert report["memory_per_rank"]["largest"] == "reproducible mode"
    bad = tmp_path / "bad.yaml"
    bad.write_text(EXAMPLE.read_text().replace("shard: 64", "shard: 32"))
    assert main(["plan", str(bad), "--world", "512", "--model", MODEL]) == 1
    out = capsys.readouterr().out
    assert "the launch would refuse it (1):" in out
    assert "trainer.fsdp: fsdp.replicate=8 x fsdp.shard=32 must equal the world size 512" in out
    invalid = tmp_path / "invalid.yaml"
    invalid.write_text("trainer:\n  reproducible: {global_batch_size: 5, micro_batch_size: 2}\n")
    assert main(["plan", str(invalid), "--world", "2", "--model", MODEL]) == 1
    out = capsys.readouterr().out
    assert "the launch would refuse it (1):\n  config: invalid config:\n" in out
    assert "global_batch_size=5 is not a multiple of micro_batch_size=2" in out


def test_a_mistake_in_the_command_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = ["plan", str(EXAMPLE), "--world", "8"]
    assert main([*args, "--model", "examples.plan.model:nothing"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == (
        "nn-handler plan: --model 'examples.plan.model:nothing': examples.plan.model has no "
        "function nothing."
    )
    assert main([*args, "--model", "examples.plan.model"]) == 2
    assert "give MODULE:FACTORY, e.g. train:build_model" in capsys.readouterr().err
    assert main([*args, "--model", "no_such_module:f"]) == 2
    assert "cannot import no_such_module" in capsys.readouterr().err
    assert main(["plan", "missing.yaml", "--world", "8", "--model", MODEL]) == 2
    assert "cannot read config file missing.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main([*args, "--model", MODEL, "--device-memory", "lots"])
    assert exit_.value.code == 2
    assert "'lots' is not a size" in capsys.readouterr().err


def test_the_docs_show_the_output_the_commands_print(capsys: pytest.CaptureFixture[str]) -> None:
    """docs/planning.md's examples, run as written: each output block is what its command
    prints."""
    docs = (Path(__file__).parents[2] / "docs" / "planning.md").read_text()
    pairs = docs.split("```bash\n")[1:]
    assert len(pairs) == 2
    for pair in pairs:
        command, after = pair.split("```", 1)
        argv = command.replace("\\\n", " ").split()
        assert argv[:2] == ["nn-handler", "plan"]
        assert main(argv[1:]) == 0
        shown = after.split("```text\n", 1)[1].split("```", 1)[0]
        assert capsys.readouterr().out == shown


def test_a_mode_whose_collectives_are_not_planned_says_so() -> None:
    floats = {"global_batch_size": 8, "micro_batch_size": 2, "reduction": "float"}
    plan = plan_run({"trainer": {"reproducible": floats}}, 4, lambda: torch.nn.Linear(3, 2))
    assert plan.collectives is None
    assert "collectives per step: not planned for this mode yet" in plan_table(plan)
    plain = plan_run({"trainer": {"strategy": "ddp"}}, 4, lambda: torch.nn.Linear(3, 2))
    assert [(c.op, c.group, c.bytes, c.count) for c in plain.collectives or []] == [
        ("all_reduce", "world", 32, 1)
    ]


def test_a_resume_at_another_world_is_what_the_launch_says_or_its_refusal() -> None:
    """The launch's own words (checkpoint_format.world_change_note): refused without
    checkpoint.allow_world_size_change, re-sharded with it; a sharded reproducible run resumed
    at more ranks than micro-batches is refused as its launch there would be."""
    linear = lambda: torch.nn.Linear(2, 2)  # noqa: E731
    refused = plan_run({"trainer": {"strategy": "ddp"}}, 4, linear, resume_world=8)
    assert refused.data is not None and refused.data.resume is None
    [refusal] = refused.refusals
    assert refusal.where == "resume at 8 ranks"
    assert refusal.message.startswith("a checkpoint of this run was written by 4 rank(s); this")
    allowed = {"trainer": {"strategy": "ddp"}, "checkpoint": {"allow_world_size_change": True}}
    taken = plan_run(allowed, 4, linear, resume_world=8)
    assert taken.refusals == [] and taken.data is not None
    assert taken.data.resume == (
        "resuming a checkpoint of this run (written by 4 ranks) with 8 ranks: the data is "
        "re-sharded, so the order differs from an uninterrupted run from here on (the rest of "
        "the interrupted epoch visits each of its remaining samples once)"
    )
    exact = {"global_batch_size": 8, "micro_batch_size": 2}
    sharded = {"trainer": {"strategy": "fsdp", "reproducible": exact}}
    plan = plan_run(sharded, 2, linear, resume_world=8)
    assert [r.where for r in plan.refusals] == ["resume at 8 ranks"]
    assert "a step has 4 micro-batches" in plan.refusals[0].message


def test_a_fault_tolerant_member_plans_the_copy_of_each_sum_it_keeps() -> None:
    """A member keeps each step's int64 sum for a redo without a lost member (ExactStep's
    ``unsent``): twice the float32 gradients' bytes, in the plan (the held bytes against it:
    test_step_fault_tolerance.py's NNHandler run); its collectives are not planned yet."""
    exact = {"global_batch_size": 8, "micro_batch_size": 2}
    member = {"reproducible": exact, "fault_tolerance": {"lighthouse": "http://127.0.0.1:1"}}
    plan = plan_run({"trainer": member}, 1, lambda: torch.nn.Linear(10, 10), device_type="cpu")
    assert plan.memory is not None and plan.refusals == []
    items = {name: size for name, size, _ in plan.memory.items}
    assert items["fault tolerance"] == 2 * 110 * 4  # int64 of 110 float32 parameters
    assert items["reproducible mode"] == 4 * 110 * 4 and items["micro-batch gradients"] == 440
    assert plan.collectives is None
    # A join between two steps: the state in flight twice (bytes and tensors), no gradients.
    state = items["parameters"] + items["optimizer state"]
    assert items["a member's join"] == 2 * state > 0
    skipped = ("gradients", "activations", "validation")
    assert plan.memory.total >= sum(v for k, v in items.items() if k not in skipped)


def test_a_join_between_two_steps_is_a_peak_of_its_own() -> None:
    """The state in flight at a join coexists with the parameters and the optimizer state,
    never with a step's gradients or activations: the plan's peak is the larger."""
    from nn_handler.strategies.memory_plan import JOIN, Layout, MemoryPlan

    items = (("parameters", 10, ""), ("gradients", 5, ""), ("optimizer state", 20, ""),
             ("activations", 8, ""))  # fmt: skip
    assert MemoryPlan(Layout("single"), items).total == 10 + 8 + 20  # backward's peak
    assert MemoryPlan(Layout("single"), (*items, (JOIN, 60, ""))).total == 10 + 20 + 60
    assert MemoryPlan(Layout("single"), (*items, (JOIN, 2, ""))).total == 10 + 8 + 20


def test_a_factory_that_fails_on_meta_is_one_line_naming_the_fix() -> None:
    from nn_handler.errors import ConfigError

    def reads_weights() -> torch.nn.Module:
        raise FileNotFoundError("weights.pt")

    with pytest.raises(ConfigError, match=r"the model factory failed on the meta device "
                       r"\(FileNotFoundError: weights.pt\); it must build"):  # fmt: skip
        plan_run({}, 2, reads_weights)
    with pytest.raises(ConfigError, match="returned a str: return the model"):
        plan_run({}, 2, lambda: "model")  # type: ignore[arg-type,return-value]

    class DataDependent(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x[: int(x.sum().item())]

    with pytest.raises(ConfigError, match="forward does not run on the meta device"):
        plan_run({}, 2, lambda: (DataDependent(), torch.ones(2, 2)))
