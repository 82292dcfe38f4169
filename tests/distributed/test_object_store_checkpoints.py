"""Checkpoints on an object store with real gloo groups, against a real S3 server (moto on
127.0.0.1): 2 ranks that share no disk (each rank its own working copy, as on two machines)
write a DDP single file and FSDP2 sharded folders (every rank uploads its own shards, rank 0
commits), resume bit-exact on "fresh machines" (empty working copies), and a 2-rank sharded
checkpoint resumes in one process. One 2-rank group runs every 2-rank check.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import HandlerConfig, NNHandler
from nn_handler.checkpoint.manifest import SUFFIX
from tests.harness import run_group
from tests.object_store import Bucket, s3, s3_server
from tests.training_helpers import max_difference, mlp, regression_data

__all__ = ["s3", "s3_server"]  # fixtures

pytestmark = pytest.mark.distributed

DATA = regression_data()
VAL = regression_data(n=14, seed=1)


def _adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def _config(world: int, url: str | None, staging: str | None, strategy: str, **ckpt: Any) -> Any:
    trainer: dict[str, Any] = {"progress_bar": False, "strategy": strategy}
    if strategy == "fsdp":
        trainer["fsdp"] = {"blocks": ["Linear"]}
    return HandlerConfig.from_dict(
        {
            "loader": {"batch_size": 8 // world, "shuffle": True, "seed": 3},
            "trainer": trainer,
            "checkpoint": {"dir": url, "staging_dir": staging, "keep_last": 5, **ckpt},
        }
    )


def _whole(handler: NNHandler) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(
        handler.trainer.module, options=StateDictOptions(full_state_dict=True)
    )
    return {k: v.detach().clone() for k, v in state.items()}


def _run(world: int, strategy: str, url: str | None, staging: str | None, epochs: int, **kw: Any
         ) -> tuple[dict[str, torch.Tensor], list[float]]:  # fmt: skip
    seed = kw.pop("seed", 0)
    config = _config(world, url, staging, strategy, **kw)
    with NNHandler(mlp(seed), _adam, nn.CrossEntropyLoss(), config=config) as h:
        h.train(DATA, VAL, epochs=epochs)
        return _whole(h), [r["val_loss"] for r in h.history.records]


def _two_ranks(rank: int, world: int, base: str, bucket: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for strategy, extra in (("ddp", {}), ("fsdp", {"async_save": True})):
        url = f"{bucket}/{strategy}"
        out[f"{strategy}_straight"] = _run(2, strategy, None, None, 3)
        first = f"{base}/{strategy}-machine{rank}-first"  # no disk shared between ranks
        out[f"{strategy}_epoch1"] = _run(2, strategy, url, first, 1, **extra)[0]
        out[f"{strategy}_first_files"] = sorted(p.name for p in Path(first).glob("*"))
        fresh = f"{base}/{strategy}-machine{rank}-fresh"
        # Other initial weights: only a resume makes them end as the straight run's.
        out[strategy] = _run(2, strategy, url, fresh, 3, resume="auto", seed=5, **extra)
        out[f"{strategy}_fetched"] = sorted(p.name for p in Path(fresh).glob("ckpt-e0001*"))
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> dict[str, Any]:
    import os

    base = tmp_path_factory.mktemp("object-store")
    env = {**s3_server.env(), "XDG_CACHE_HOME": str(base / "cache")}  # not ~/.cache
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the children's credentials, the standard way
    try:
        bucket = Bucket(s3_server, f"two-ranks-{uuid.uuid4().hex[:8]}")
        bucket.fs().mkdir(bucket.name)
        ranks = run_group(_two_ranks, 2, args=(str(base), bucket.url), timeout=300)
        listing = {
            key.split("/", 1)[1]: info["size"]
            for key, info in bucket.fs().find(bucket.name, detail=True).items()
        }
        latest = json.loads(bucket.fs().cat(f"{bucket.name}/fsdp/latest.json"))
        # The 2-rank sharded checkpoint of epoch 1, resumed in one process.
        config = _config(1, None, None, "auto", staging_dir=str(base / "single"))
        with NNHandler(mlp(seed=5), _adam, nn.CrossEntropyLoss(), config=config) as h:
            h.trainer.resume(
                f"{bucket.url}/fsdp/ckpt-e0001-s00000005", allow_world_size_change=True
            )
            single = {k: v.detach().clone() for k, v in h.model.state_dict().items()}
            h.train(DATA, epochs=2)
            single_epoch = h.trainer.state.epoch
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    return {"ranks": ranks, "listing": listing, "latest": latest, "single": single,
            "single_epoch": single_epoch}  # fmt: skip


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_resume_on_fresh_machines_is_bit_exact(runs: dict[str, Any], strategy: str) -> None:
    for seen in runs["ranks"]:
        weights, losses = seen[strategy]
        straight_weights, straight_losses = seen[f"{strategy}_straight"]
        assert max_difference(weights, straight_weights) == 0.0
        assert losses == straight_losses


def test_every_rank_uploads_its_shards_and_rank_0_commits(runs: dict[str, Any]) -> None:
    listing = runs["listing"]
    folder = "fsdp/ckpt-e0003-s00000015"
    assert {k for k in listing if k.startswith(f"{folder}/")} == {
        f"{folder}/{name}" for name in (".metadata", "__0_0.distcp", "__1_0.distcp", "trainer.pt")
    }  # its manifest is beside it, one format (each shard's tensors' CRC-32s in it too)
    assert f"{folder}{SUFFIX}" in listing
    assert runs["latest"]["checkpoint"] == "ckpt-e0003-s00000015"
    ddp = sorted(k for k in listing if k.startswith("ddp/") and k.endswith(SUFFIX))
    assert ddp == [f"ddp/ckpt-e000{e}-s0000000{s}.pt{SUFFIX}" for e, s in ((1, 5),)] + [
        f"ddp/ckpt-e000{e}-s000000{s}.pt{SUFFIX}" for e, s in ((2, 10), (3, 15))
    ]


def test_every_fresh_machine_downloaded_the_checkpoint_it_resumed(runs: dict[str, Any]) -> None:
    for seen in runs["ranks"]:
        assert seen["ddp_fetched"] == ["ckpt-e0001-s00000005.pt"]
        assert seen["fsdp_fetched"] == ["ckpt-e0001-s00000005"]


def test_a_rank_keeps_no_other_rank_s_staging_files(runs: dict[str, Any]) -> None:
    rank1 = runs["ranks"][1]
    assert not any(".tmp-" in name for name in rank1["fsdp_first_files"])


def test_a_two_rank_sharded_checkpoint_resumes_in_one_process(runs: dict[str, Any]) -> None:
    for seen in runs["ranks"]:
        assert max_difference(runs["single"], seen["fsdp_epoch1"]) == 0.0
    assert runs["single_epoch"] == 2
