"""Loaders in real 2-rank gloo groups: equal steps under DDP, exact evaluation, shards."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import TensorDataset

from nn_handler import DistributedContext, LoaderConfig, LoaderFactory
from nn_handler.data import gather_in_dataset_order, weighted_mean
from tests.harness import run_group

pytestmark = pytest.mark.distributed
MODES = ["distributed", "rank_cached"]


def _ddp_epochs(rank: int, world_size: int) -> dict[str, Any]:
    ctx = DistributedContext().setup()  # adopts the harness's group
    comm = ctx.communicator
    seen: dict[str, Any] = {}
    # 37 samples, batch 4: rank loaders would disagree without the equal-steps rule.
    dataset = TensorDataset(torch.randn(37, 3, generator=torch.Generator().manual_seed(0)))
    for mode in MODES:
        for drop_last in (False, True):
            torch.manual_seed(0)
            model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(3, 1))
            config = LoaderConfig(batch_size=4, mode=mode, drop_last=drop_last)
            loader = LoaderFactory.from_context(config, ctx).train_loader(dataset)
            steps = []
            for epoch in range(2):
                loader.set_epoch(epoch)
                count = 0
                for (x,) in loader:  # one DDP all-reduce per batch: a missing batch would hang
                    model(x).sum().backward()
                    count += 1
                steps.append(count)
            seen[f"{mode}/{drop_last}"] = comm.all_gather_object(steps)
    return seen


def test_every_rank_takes_the_same_steps_so_ddp_never_waits() -> None:
    for seen in run_group(_ddp_epochs, 2, timeout=90):
        for mode in MODES:
            assert seen[f"{mode}/False"] == [[5, 5], [5, 5]]  # ceil(ceil(37/2)/4)
            assert seen[f"{mode}/True"] == [[4, 4], [4, 4]]  # floor(floor(37/2)/4)


def _exact_evaluation(rank: int, world_size: int, mode: str) -> dict[str, Any]:
    ctx = DistributedContext().setup()
    torch.manual_seed(0)
    x = torch.randn(1001, 5)
    y = torch.randint(0, 3, (1001,))
    model = torch.nn.Linear(5, 3)
    loader = LoaderFactory.from_context(LoaderConfig(batch_size=64, mode=mode), ctx).eval_loader(
        TensorDataset(x, y)
    )
    logits, correct, loss_sum, count = [], 0, 0.0, 0
    with torch.no_grad():
        for xb, yb in loader:
            out = model(xb)
            logits.append(out)
            correct += int((out.argmax(1) == yb).sum())
            loss_sum += float(torch.nn.functional.cross_entropy(out, yb, reduction="sum"))
            count += len(yb)
    local = torch.cat(logits)
    ordered = gather_in_dataset_order(
        {"logits": local, "index": torch.tensor(loader.indices)},
        loader.indices,
        ctx.communicator,
        total=1001,
    )
    metrics = weighted_mean(
        {"accuracy": correct / count, "loss": loss_sum / count}, count, ctx.communicator
    )
    with torch.no_grad():  # what one process computes over the whole dataset
        full = model(x)
    single = {
        "accuracy": int((full.argmax(1) == y).sum()) / len(y),
        "loss": float(torch.nn.functional.cross_entropy(full, y)),
    }
    return {
        "count": count,
        "in_order": torch.equal(ordered["logits"], full),
        "index": ordered["index"].tolist(),
        "metrics": metrics,
        "single": single,
    }


@pytest.mark.parametrize("mode", MODES)
def test_exact_evaluation_equals_one_process_in_dataset_order(mode: str) -> None:
    results = run_group(_exact_evaluation, 2, args=(mode,), timeout=90)
    assert [r["count"] for r in results] == [501, 500], "no padding, nothing dropped"
    for r in results:
        assert r["in_order"], "gathered predictions equal single-process ones, in order"
        assert r["index"] == list(range(1001))
        assert r["metrics"]["accuracy"] == r["single"]["accuracy"]
        assert r["metrics"]["loss"] == pytest.approx(r["single"]["loss"], rel=1e-6)


def _orders_and_shards(rank: int, world_size: int) -> dict[str, Any]:
    ctx = DistributedContext().setup()
    comm = ctx.communicator
    dataset = TensorDataset(torch.arange(50))
    seen: dict[str, Any] = {}
    for mode in MODES:
        orders = {}
        for epoch in (3, 3, 4):  # a fresh factory each time, as a new run would build
            loader = LoaderFactory.from_context(LoaderConfig(batch_size=5, mode=mode), ctx)
            train = loader.train_loader(dataset)
            train.set_epoch(epoch)
            orders.setdefault(epoch, []).append([i for (b,) in train for i in b.tolist()])
        seen[f"{mode}/repeat"] = orders[3][0] == orders[3][1]
        seen[f"{mode}/new_epoch"] = orders[3][0] != orders[4][0]
        seen[f"{mode}/all"] = comm.all_gather_object(orders[3][0])
    cached = LoaderFactory.from_context(LoaderConfig(mode="rank_cached"), ctx)
    odd = TensorDataset(torch.arange(51))
    seen["train_shards"] = comm.all_gather_object(cached.train_loader(odd).dataset.indices)
    seen["eval_shards"] = comm.all_gather_object(cached.eval_loader(odd).dataset.indices)
    return seen


def test_shuffles_repeat_and_rank_cached_shards_are_disjoint_and_complete() -> None:
    seen = run_group(_orders_and_shards, 2, timeout=90)[0]
    for mode in MODES:
        assert seen[f"{mode}/repeat"] and seen[f"{mode}/new_epoch"]
        rank0, rank1 = seen[f"{mode}/all"]
        assert sorted(rank0 + rank1) == list(range(50)), "one epoch covers the data once"
    train0, train1 = seen["train_shards"]
    assert len(train0) == len(train1) == 26, "balanced: 51 samples padded to 52"
    assert set(train0) | set(train1) == set(range(51)), "complete"
    assert len(set(train0) & set(train1)) == 1, "disjoint but for the one padded sample"
    eval0, eval1 = seen["eval_shards"]
    assert sorted(eval0 + eval1) == list(range(51)) and not set(eval0) & set(eval1)
