"""A sharded member's state sent rank by rank (training/fault_tolerance/shards.py), in real gloo
groups. Four ranks: two members of 2 ranks, each FSDP2 over its own ranks (a 2 x 2 mesh, the
member the outer dimension); rank i of the live member sends its shards to rank i of the
joining one through VerifiedTransport, and the joiner trains on to the live member's bits; a
member sharded over another number of ranks is refused with the fix. Two ranks: the Trainer's
member state (TrainerCheckpoints.member_state) makes a fresh sharded Trainer go on with the
same bits.
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from typing import Any

import pytest
import torch
from torch import nn

from tests.harness import run_group

pytestmark = pytest.mark.distributed
pytest.importorskip("torchft")


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 3))


def _step(model: nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    x, y = torch.randn(4, 6, generator=generator), torch.randint(0, 3, (4,), generator=generator)
    nn.functional.cross_entropy(model(x), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _sha(model: nn.Module, optimizer: torch.optim.Optimizer) -> str:
    """The SHA-256 of the gathered weights and Adam moments (a collective in the member)."""
    digest = hashlib.sha256()
    for tensor in [*model.parameters(), *(v for s in optimizer.state.values() for v in s.values())]:
        full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
        digest.update(full.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _member_checks(rank: int, world_size: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    from nn_handler.errors import CheckpointError, ConfigError
    from nn_handler.training.fault_tolerance.shards import local_state, take_local_state
    from nn_handler.training.fault_tolerance.transport import VerifiedTransport

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("member", "shard"))
    member = mesh.get_coordinate()[0]
    model = _model(seed=member)  # the members start apart
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    _step(model, optimizer, seed=100 + member)  # each its own: the joiner's state is stale
    out: dict[str, Any] = {"member": member, "before": _sha(model, optimizer)}
    params = [id(p) for p in model.parameters()]

    # Rank i of member 0 sends its shards to rank i of member 1 (ranks 0 and 1 of the group).
    link = VerifiedTransport(mesh["member"].get_group(), timedelta(seconds=30))
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    if member == 0:
        link.send_checkpoint([1], 1, local_state(state), timedelta(seconds=30))
    else:
        where = f"the shards of rank {mesh.get_coordinate()[1]} of member 0"
        received = link.recv_checkpoint(0, link.metadata(), 1, timedelta(seconds=30))
        out["sent_plain"] = all(
            type(v) is torch.Tensor for v in received["state"]["model"].values()
        )
        filled = take_local_state(state, received, where)
        model.load_state_dict(filled["model"])
        optimizer.load_state_dict(filled["optimizer"])
    out["same_parameters"] = params == [id(p) for p in model.parameters()]
    out["joined"] = _sha(model, optimizer)
    _step(model, optimizer, seed=7)  # the same step on both members from now on
    out["after"] = _sha(model, optimizer)

    # A member sharded over 4 ranks cannot take the shards of one sharded over 2.
    two = distribute_tensor(torch.arange(32.0).reshape(8, 4), mesh["shard"], [Shard(0)])
    four = distribute_tensor(torch.zeros(8, 4), init_device_mesh("cpu", (4,)), [Shard(0)])
    try:
        take_local_state({"w": four}, local_state({"w": two}), "the shards of member 0")
    except ConfigError as error:
        out["resized"] = str(error)
    out["untouched"] = bool(torch.all(four.to_local() == 0))
    # Another model: a tensor of another shape, on the same layout.
    shorter = distribute_tensor(torch.zeros(6, 4), mesh["shard"], [Shard(0)])
    try:
        take_local_state({"w": shorter}, local_state({"w": two}), "the shards of member 0")
    except ConfigError as error:
        out["reshaped"] = str(error)
    # A shard of another dtype is refused before anything is copied.
    payload = local_state({"a": two, "b": two})
    payload["state"]["b"] = payload["state"]["b"].double()
    mine = distribute_tensor(torch.zeros(8, 4), mesh["shard"], [Shard(0)])
    other = distribute_tensor(torch.zeros(8, 4), mesh["shard"], [Shard(0)])
    try:
        take_local_state({"a": mine, "b": other}, payload, "the shards of member 0")
    except CheckpointError as error:
        out["dtype"] = str(error)
    out["none_copied"] = bool(torch.all(mine.to_local() == 0))
    return out


def test_a_joining_member_takes_the_shards_rank_by_rank_and_ends_with_the_same_bits() -> None:
    results = run_group(_member_checks, 4, timeout=120)
    live, joiner = [r for r in results if r["member"] == 0], [r for r in results if r["member"]]
    assert live[0]["before"] != joiner[0]["before"]  # the members were apart before the join
    assert {r["joined"] for r in results} == {live[0]["before"]}  # then one state
    assert len({r["after"] for r in results}) == 1  # and they train on alike
    assert all(r["sent_plain"] for r in joiner)  # only local shards travel, no mesh
    assert all(r["same_parameters"] for r in results)  # filled in place
    for r in results:
        assert "mesh of [2] ranks" in r["resized"] and "[4]" in r["resized"]
        assert "torchrun --nproc-per-node" in r["resized"] and r["untouched"]
        assert "w has the shape (8, 4) on the sending member and (6, 4) here" in r["reshaped"]
        assert "b is float64 of shape (4, 4) there and float32" in r["dtype"]
        assert r["none_copied"]


def _trainer_checks(rank: int, world_size: int) -> dict[str, Any]:
    import io

    from nn_handler import DistributedContext
    from nn_handler.errors import CheckpointError
    from tests.reproducible_helpers import full_digest, handler, sharded, train

    context = DistributedContext().setup()
    out: dict[str, Any] = {}
    live = handler("cnn", context, **sharded("cnn", {}))
    train(live, "cnn", epochs=1)
    # What rank r of the live member sends, as the transport carries it (weights-only bytes).
    sent = io.BytesIO()
    torch.save(live.trainer.checkpointing.member_state(), sent)
    received = torch.load(io.BytesIO(sent.getvalue()), weights_only=True)
    joiner = handler("cnn", context, **sharded("cnn", {}))  # fresh: a member that joins
    out["apart"] = full_digest(joiner) != full_digest(live)
    for group in joiner.trainer.optimizer.param_groups:  # type: ignore[union-attr]
        group["lr"] = 1.0  # taken from the live member's optimizer state too
    # Without the member's unsharded rest: refused before any shard of the joiner changes.
    before = full_digest(joiner)
    try:
        joiner.trainer.checkpointing.take_member_state({**received, "rest": None}, "no rest")
    except CheckpointError as error:
        out["no_rest"] = str(error)
    out["unchanged"] = full_digest(joiner) == before
    joiner.trainer.checkpointing.take_member_state(received, f"the state of rank {rank}")
    out["joined"] = full_digest(joiner) == full_digest(live)
    out["step"] = (joiner.trainer.state.global_step, live.trainer.state.global_step)
    train(live, "cnn", epochs=2)  # both go on with the second epoch: dropout, BN, Adam
    train(joiner, "cnn", epochs=2)
    out["same_end"] = full_digest(joiner) == full_digest(live)
    live.close()
    joiner.close()
    return out


def test_a_sharded_trainers_member_state_makes_a_fresh_one_go_on_with_the_same_bits() -> None:
    """The Trainer's state of a member of 2 FSDP2 ranks (the reproducible CNN: BatchNorm,
    dropout, Adam), rank by rank: a fresh member that takes it is at the same step with the
    same bits, and ends the next epoch with the same SHA-256 as the member it came from."""
    results = run_group(_trainer_checks, 2, timeout=180)
    for r in results:
        assert r["apart"] and r["joined"] and r["same_end"], r
        assert "no rest is not an nn_handler training checkpoint" in r["no_rest"]
        assert r["unchanged"]
        assert r["step"][0] == r["step"][1] > 0
