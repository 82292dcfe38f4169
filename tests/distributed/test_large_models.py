"""Large-model features in real gloo groups: a model built on the meta device trains to the
same loss curve under DDP over 4 ranks, FSDP2 over 4 and HSDP 2 x 2 (the same initial weights
under every layout); FSDP2 with full activation checkpointing and per-block compile, and DDP
with checkpointing, train as without; pretrained weights load into each rank's shards from a
file and from a sharded folder; the HSDP checkpoint resumes on FSDP2 over 2 ranks. One 4-rank
group, one 2-rank group.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from nn_handler import NNHandler
from tests.harness import run_group
from tests.large_model_helpers import adam, blocks_data, blocks_model, whole_state

pytestmark = pytest.mark.distributed

BLOCKS = {"blocks": ["Block"]}


def _config(world: int, folder: Path | None = None, **trainer: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "loader": {"batch_size": 16 // world, "shuffle": True, "seed": 1},
        "trainer": {"progress_bar": False, **trainer},
        "logging": {"monitor": False},
    }
    if folder is not None:
        config["checkpoint"] = {"dir": str(folder), "format": "sharded", "every_n_epochs": 1}
    return config


def _train(world: int, epochs: int = 3, folder: Path | None = None, **trainer: Any) -> Any:
    with NNHandler(
        blocks_model(), adam, nn.CrossEntropyLoss(), config=_config(world, folder, **trainer)
    ) as h:
        initial = whole_state(h.trainer.module)
        h.train(blocks_data(), epochs=epochs)
        losses = [r["train_loss"] for r in h.history.records]
        return initial, losses, whole_state(h.trainer.module), h.trainer.strategy


def _four(rank: int, world: int, folder: str) -> dict[str, Any]:
    base = Path(folder)
    out: dict[str, Any] = {}
    out["ddp_initial"], out["ddp"], _, _ = _train(world, strategy="ddp")
    out["fsdp_initial"], out["fsdp"], _, _ = _train(world, strategy="fsdp", fsdp=BLOCKS)
    hsdp = {**BLOCKS, "replicate": 2}
    out["hsdp_initial"], out["hsdp"], out["hsdp_final"], strategy = _train(
        world, folder=base / "hsdp", strategy="fsdp", fsdp=hsdp
    )
    out["mesh"] = strategy.mesh_shape
    out["local"] = sum(p.to_local().numel() for p in strategy.module.parameters())
    recomputed = {**BLOCKS, "activation_checkpointing": "full"}
    compiled = {"compile": "blocks", "compile_kwargs": {"backend": "aot_eager"}}
    _, out["fsdp_ac_compiled"], _, strategy = _train(
        world, strategy="fsdp", fsdp=recomputed, **compiled
    )
    _, out["ddp_ac"], _, _ = _train(world, strategy="ddp", fsdp=recomputed)
    out["compiled_blocks"] = sum(
        getattr(b, "_compiled_call_impl", None) is not None for b in strategy.blocks
    )
    # Pretrained weights: a file every rank reads its pieces of, and a sharded folder.
    torch.manual_seed(5)  # the same weights on every rank: what rank 0 saves
    pretrained = blocks_model(meta=False)
    if rank == 0:
        torch.save(pretrained.state_dict(), base / "pretrained.pt")
    torch.distributed.barrier()
    expected = {k: v.clone() for k, v in pretrained.state_dict().items()}
    out["from_file"] = _loaded(world, str(base / "pretrained.pt"), expected)
    out["from_folder"] = _loaded(world, str(_last(base / "hsdp")), out["hsdp_final"])
    return out


def _loaded(world: int, path: str, expected: dict[str, torch.Tensor]) -> float:
    config = _config(world, strategy="fsdp", fsdp=BLOCKS, init_weights=path)
    with NNHandler(blocks_model(), adam, nn.CrossEntropyLoss(), config=config) as h:
        state = whole_state(h.trainer.module)
    return max(float((state[k] - expected[k]).abs().max()) for k in expected)


def _last(folder: Path) -> Path:
    return sorted(folder.glob("ckpt-*"))[-1]


def _two(rank: int, world: int, folder: str) -> dict[str, Any]:
    """FSDP2 over 2 ranks resumes the HSDP 2 x 2 run's last checkpoint and trains on."""
    config = _config(world, strategy="fsdp", fsdp=BLOCKS)
    with NNHandler(blocks_model(), adam, nn.CrossEntropyLoss(), config=config) as h:
        h.trainer.resume(str(_last(Path(folder) / "hsdp")), allow_world_size_change=True)
        resumed = whole_state(h.trainer.module)
        h.train(blocks_data(), epochs=4)
        return {"resumed": resumed, "epochs": len(h.history.records), "loss": h.history.last}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("large")


@pytest.fixture(scope="module")
def four(folder: Path) -> list[dict[str, Any]]:
    return run_group(_four, 4, args=(str(folder),), timeout=300)


def test_a_meta_model_starts_from_the_same_weights_under_every_layout(
    four: list[dict[str, Any]],
) -> None:
    for seen in four:
        for layout in ("fsdp_initial", "hsdp_initial"):
            for key, value in seen["ddp_initial"].items():
                assert torch.equal(seen[layout][key], value), (layout, key)
    first = four[0]["ddp_initial"]["1.linear.weight"]
    assert first.std() > 0.05  # initialised, not zeros; and each row its own draw
    assert len({tuple(row.tolist()) for row in first}) == first.shape[0]


def test_hsdp_2x2_trains_like_fsdp_4_and_ddp_4(four: list[dict[str, Any]]) -> None:
    for seen in four:
        assert seen["mesh"] == (2, 2)
        assert seen["hsdp"] == pytest.approx(seen["fsdp"], rel=1e-5)
        assert seen["hsdp"] == pytest.approx(seen["ddp"], rel=1e-5)
        assert seen["hsdp"][-1] < seen["hsdp"][0]
    total = sum(v.numel() for v in four[0]["ddp_initial"].values())
    assert four[0]["local"] < total  # each rank holds a shard: about half under 2 x 2


def test_activation_checkpointing_and_block_compile_train_as_without(
    four: list[dict[str, Any]],
) -> None:
    for seen in four:
        assert seen["compiled_blocks"] == 3
        assert seen["fsdp_ac_compiled"] == pytest.approx(seen["fsdp"], rel=1e-5)
        assert seen["ddp_ac"] == pytest.approx(seen["ddp"], rel=1e-6)  # under DDP too


def test_pretrained_weights_load_into_the_shards_from_a_file_and_a_folder(
    four: list[dict[str, Any]],
) -> None:
    for seen in four:
        assert seen["from_file"] == 0.0
        assert seen["from_folder"] == 0.0


def test_the_hsdp_checkpoint_resumes_on_fsdp_over_two_ranks(
    four: list[dict[str, Any]], folder: Path
) -> None:
    two = run_group(_two, 2, args=(str(folder),), timeout=180)
    for seen in two:
        for key, value in four[0]["hsdp_final"].items():
            assert torch.equal(seen["resumed"][key], value), key
        assert seen["epochs"] == 4
        assert seen["loss"]["train_loss"] < four[0]["hsdp"][0]
