"""Write RESULTS.md from the benchmarks' JSON results: one table per benchmark.

    python benchmarks/report.py [--results benchmarks/results] [--out benchmarks/RESULTS.md]

Every figure is shown with its ratio to the baseline measured in the same run (raw PyTorch,
torch.distributed, torch.save, ...) and the spread of the per-repetition ratios, because
absolute times on shared machines drift. The page is a pure function of the JSON files, so a
test can check that the committed page matches the committed results.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

ORDER = [
    "training_step",
    "object_collectives",
    "communicator_overhead",
    "loader_cache",
    "ema_update",
    "checkpoint_io",
    "object_store_checkpoints",
    "async_saves",
    "scaling",
    "fsdp_sharding",
    "reproducible",
    "fault_tolerance",
    "memory_plan",
    "realistic",
]
Table = list[str]


def _table(header: Iterable[str], rows: Iterable[Iterable[Any]]) -> Table:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return lines


def _x(value: float) -> str:
    return f"{value:.2f}x"


def _spread(pair: list[float]) -> str:
    return f"{pair[0]:.2f}-{pair[1]:.2f}"


def _ms(value: float) -> str:
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


HEADER = ["variant", "ms/step", "ratio to raw", "spread", "95% interval", "overhead ms/step"]


def training_step(data: dict[str, Any]) -> Table:
    lines: Table = [
        "Median ms per training step and, per variant, the median, spread (min-max) and 95% "
        "interval of the median of the ratio to the raw loop over the interleaved repetitions, "
        "and the median overhead in ms per step. Below each table, NNHandler's time over each "
        "peer's in the same repetition, over itself with the throughput monitor off, and (two "
        "processes) over itself with the stall watchdog off.",
        "",
    ]
    for result in data["results"]:
        rows = [
            (
                name,
                _ms(row["ms_per_step"]),
                _x(row["ratio_median"]),
                _spread(row["ratio_spread"]),
                _spread(row["ratio_ci95"]),
                f"{row['overhead_ms_per_step_median']:+.3f}",
            )
            for name, row in result["variants"].items()
        ]
        versus = [
            (
                f"nn_handler / {peer}",
                _x(row["ratio_median"]),
                _spread(row["ratio_spread"]),
                _spread(row["ratio_ci95"]),
            )
            for peer, row in result["nn_handler_vs_peers"].items()
        ]
        for key, label in (
            ("monitor_on_vs_off", "monitor on / off"),
            ("watchdog_on_vs_off", "watchdog on / off"),
        ):
            if key in result:
                row = result[key]
                versus.append(
                    (
                        label,
                        _x(row["ratio_median"]),
                        _spread(row["ratio_spread"]),
                        _spread(row["ratio_ci95"]),
                    )
                )
        costs = result.get("watchdog_costs")
        notes = []
        monitor = result.get("monitor_costs")
        if monitor is not None:
            notes += [
                f"Throughput monitor timed alone: {monitor['hooks_us_per_step']:.1f} µs per "
                f"step and {monitor['epoch_start_us']:.0f} µs per epoch "
                f"({100 * monitor['share_of_raw_step']:.2f}% of a raw step).",
                "",
            ]
        if costs is not None:
            notes += [
                f"Stall watchdog timed alone: {costs['region_us_per_step']:.1f} µs of "
                f"bookkeeping per step ({100 * costs['region_share_of_raw_step']:.2f}% of a raw "
                f"step); its thread looks every {costs['interval_s']:g} s and a look takes "
                f"{costs['look_ms']:.2f} ms ({100 * costs['thread_share_of_one_core']:.3f}% of "
                f"a core).",
                "",
            ]
        lines += [
            f"**world size {result['world_size']}, {result['case']}** "
            f"({result['steps_per_epoch']} steps x batch {result['batch_per_rank']} per rank, "
            f"{result['repetitions']} repetitions)",
            "",
            *_table(HEADER, rows),
            "",
            *_table(["paired", "ratio", "spread", "95% interval"], versus),
            "",
            *notes,
        ]
    return lines


def object_collectives(data: dict[str, Any]) -> Table:
    rows = [
        (
            name,
            _ms(row["torch_ms"]),
            _ms(row["nn_handler_ms"]),
            _x(row["ratio_median"]),
            _spread(row["ratio_spread"]),
            f"{row['torch_mb_per_s']:.1f} / {row['nn_handler_mb_per_s']:.1f}",
        )
        for name, row in data["objects"].items()
    ]
    tensors = [
        (
            name,
            _ms(row["bare_all_gather_into_tensor_ms"]),
            _ms(row["torch_ms"]),
            _ms(row["nn_handler_ms"]),
            _x(row["ratio_median"]),
            _spread(row["ratio_spread"]),
        )
        for name, row in data["variable_tensors"].items()
    ]
    memory = [
        (rank, _x(row["torch_peak_x_payload"]), _x(row["nn_handler_peak_x_payload"]))
        for rank, row in enumerate(data["peak_memory_per_rank"])
    ]
    header = ["payload per rank", "all_gather_object ms", "nn_handler ms", "ratio", "spread"]
    return [
        "`TorchCommunicator.all_gather_object` against `dist.all_gather_object` (ratio = ours / "
        "torch; below 1 is faster):",
        "",
        *_table([*header, "MB/s torch / ours"], rows),
        "",
        "Peak resident memory a 100 MB all-gather adds on each rank, as a multiple of the payload:",
        "",
        *_table(["rank", "all_gather_object", "nn_handler"], memory),
        "",
        "1-D float tensors of different lengths per rank: `Communicator.all_gather` (pad, gather, "
        "trim) against the same tensors through `dist.all_gather_object`, with a bare "
        "equal-length `all_gather_into_tensor` as the floor:",
        "",
        *_table(
            ["elements", "bare ms", "object route ms", "nn_handler ms", "ratio", "spread"],
            tensors,
        ),
    ]


def communicator_overhead(data: dict[str, Any]) -> Table:
    single = [(name, f"{us:.2f}") for name, us in data["single_process_us_per_call"].items()]
    rows = []
    for entry in data["gloo_world2_all_reduce"]:
        for name, row in entry.items():
            if isinstance(row, dict):
                rows.append(
                    (
                        f"{entry['numel']:,}",
                        name,
                        f"{row['raw_us_median']:.0f}",
                        f"{row['ours_us_median']:.0f}",
                        _x(row["ratio_median"]),
                        _spread([row["ratio_min"], row["ratio_max"]]),
                    )
                )
    return [
        "One process (NullCommunicator), µs per call:",
        "",
        *_table(["call", "µs"], single),
        "",
        "Two processes on gloo, µs per all-reduce:",
        "",
        *_table(["floats", "comparison", "torch µs", "ours µs", "ratio", "spread"], rows),
    ]


def loader_cache(data: dict[str, Any]) -> Table:
    rows = []
    for rank, timings in enumerate(data["per_rank"]):
        for name, row in timings.items():
            spread = row.get("later_epoch_spread_s")
            rows.append(
                (
                    rank,
                    name,
                    f"{row['first_epoch_s']:.3f}",
                    f"{row['later_epoch_s']:.3f}",
                    _spread(spread) if spread else "",
                )
            )
    ratios = [
        (
            r["rank"],
            _x(r["later_epoch_speedup_vs_distributed_w0"]),
            _spread(r["later_epoch_speedup_vs_distributed_w0_spread"])
            if "later_epoch_speedup_vs_distributed_w0_spread" in r
            else "",
        )
        for r in data["ratios"]
    ]
    return [
        f"{data['samples']:,} samples on 2 ranks, batch {data['batch_size']}, seconds per epoch:",
        "",
        *_table(["rank", "loader", "first epoch s", "later epoch s", "later spread s"], rows),
        "",
        *_table(["rank", "rank-cached later-epoch speedup", "spread"], ratios),
    ]


def _ratio_rows(
    results: dict[str, dict[str, Any]], cells: Callable[[dict[str, Any]], list[str]], key: str
) -> list[list[str]]:
    """One row per variant: its name, ``cells(row)``, the median ratio and its spread."""
    return [
        [name, *cells(row), _x(row[key]), _spread(row["ratio_spread"])]
        for name, row in results.items()
    ]


def ema_update(data: dict[str, Any]) -> Table:
    rows = _ratio_rows(
        data["results"], lambda row: [_ms(row["ms_per_update"])], "ratio_to_bare_median"
    )
    return [
        f"One EMA update of {data['parameters'] / 1e6:.0f}M parameters in {data['tensors']} "
        f"tensors ({data['repeats']} repetitions):",
        "",
        *_table(["variant", "ms/update", "ratio to bare", "spread"], rows),
    ]


def _save_table(data: dict[str, Any], heading: str) -> Table:
    """A table of save (or load) times in seconds and MB/s, with ratios to torch's call."""
    rows = _ratio_rows(
        data["results"],
        lambda row: [f"{row['seconds_median']:.3f}", f"{row['mb_per_s']:.0f}"],
        "ratio_to_torch_median",
    )
    return [heading, "", *_table(["variant", "median s", "MB/s", "ratio to torch", "spread"], rows)]


def checkpoint_io(data: dict[str, Any]) -> Table:
    return _save_table(
        data,
        f"A {data['state_dict_mb']:.0f} MB state dict in {data['tensors']} tensors "
        f"({data['repeats']} repetitions):",
    )


def object_store_checkpoints(data: dict[str, Any]) -> Table:
    return _save_table(
        data,
        f"A {data['state_dict_mb']:.0f} MB checkpoint, local disk vs a local S3 server (moto "
        f"on 127.0.0.1, through s3fs; {data['repeats']} repetitions):",
    )


def async_saves(data: dict[str, Any]) -> Table:
    lines = [
        f"A {data['parameters'] / 1e6:.0f}M-parameter model's weights ({data['state_dict_mb']:.0f}"
        f" MB), an async sharded save's stall against a memcpy of them, and a synchronous save "
        f"against an fsync'd write of the same bytes ({data['repeats']} repetitions; 2 ranks: "
        f"the slower rank of each repetition):",
        "",
    ]
    rows = []
    for world, results in data["results"].items():
        for name, row in results.items():
            seconds = f"{row['seconds_median']:.3f}"
            speed = f"{row['mb_per_s']:.0f}" if "mb_per_s" in row else ""
            ratio = row.get("ratio_median") or row.get("bandwidth_share", {}).get("ratio_median")
            versus = ""
            if "ratio_median" in row:
                versus = f"{_x(ratio)} the memcpy"
            elif "bandwidth_share" in row:
                versus = f"{ratio:.0%} of the fsync'd write's bandwidth"
            rows.append([world, name, seconds, speed, versus])
    lines += _table(["ranks", "variant", "median s", "MB/s", "against"], rows)
    every = data["every_step"]
    lines += [
        "",
        f"{every['steps']} steps on 2 ranks with an async sharded save after each: finished in "
        f"{every['seconds']:.1f} s.",
    ]
    stall = data.get("beside")
    if stall:
        lines += [
            "",
            f"A training step (1 thread) while an async save writes in the background: "
            f"{stall['step_ms_during']:.2f} ms median over {stall['steps_during']} steps, "
            f"{_x(stall['ratio_median'])} the step alone ({stall['step_ms_alone']:.2f} ms).",
        ]
    return lines


def scaling(data: dict[str, Any]) -> Table:
    cpu = data["cpu_small_cnn"]
    rows = [
        (world, cpu[f"world_{world}"]["samples"], f"{cpu[f'world_{world}']['samples_per_s']:.0f}")
        for world in (1, 2)
    ]
    gpu = data["gpu_bf16_vs_fp32"]
    gpu_lines = (
        [f"GPU bf16 against fp32: skipped ({gpu['skipped']})."]
        if "skipped" in gpu
        else [
            f"One GPU ({gpu['device']}), batch 256:",
            "",
            *_table(
                ["precision", "samples/s"],
                [(p, f"{gpu[p]['samples_per_s']:.0f}") for p in ("32", "bf16")],
            ),
            "",
            f"bf16 speedup: {_x(gpu['bf16_speedup'])}.",
        ]
    )
    return [
        "The small CNN through `NNHandler.train`, one thread per process:",
        "",
        *_table(["processes", "samples per epoch", "samples/s"], rows),
        "",
        f"Speedup with 2 processes: {_x(cpu['speedup_2_over_1'])}, efficiency "
        f"{cpu['efficiency']:.0%}.",
        "",
        *gpu_lines,
    ]


def memory_plan(data: dict[str, Any]) -> Table:
    mib = 2**20
    rows = [
        (
            case,
            r["ranks"],
            f"{r['model_state_bytes'] / mib:.0f}",
            f"{r['setup_peak_bytes'] / mib:.1f}",
            f"{r['peak_bytes'] / mib:.1f}",
            f"{r['plan_bytes'] / mib:.1f}",
            f"{r['plan_over_peak']:.3f}",
        )
        for case, r in data["results"].items()
    ]
    return [
        f"The memory plan against each rank's measured peak (model: `{data['model']}`, built on "
        "the meta device, Adam, 3 steps; the largest rank's VmHWM over its baseline; MiB):",
        "",
        *_table(
            [
                "layout",
                "ranks",
                "whole model + Adam",
                "setup peak",
                "training peak",
                "plan",
                "plan / peak",
            ],
            rows,
        ),
    ]


def reproducible(data: dict[str, Any]) -> Table:
    rows = [
        (
            case,
            f"{r['parameters']:,}",
            f"{r['epoch_seconds_normal']:.3f}",
            f"{r['epoch_seconds_reproducible']:.3f}",
            f"{_x(r['ratio_median'])} ({_x(r['ratio_spread'][0])}-{_x(r['ratio_spread'][1])})",
            f"{r['bytes_per_step_ddp'] / 2**20:.2f}",
            f"{r['bytes_per_step_reproducible'] / 2**20:.2f}",
        )
        for case, r in data["results"].items()
    ]
    digits = data["digits_val_accuracy"]
    return [
        f"TrainerConfig.reproducible against the normal mode (DDP), {data['world_size']} ranks, "
        "the same samples per step (the mode: one micro-batch per rank); epoch times are "
        "medians:",
        "",
        *_table(
            [
                "workload",
                "parameters",
                "normal s",
                "reproducible s",
                "ratio (range)",
                "DDP MiB/step",
                "mode MiB/step",
            ],
            rows,
        ),
        "",
        *_sharded_rows(data),
        f"Digits CNN (BatchNorm), 12 epochs: validation accuracy {digits['normal']:.4f} normal, "
        f"{digits['reproducible']:.4f} reproducible.",
    ]


def _sharded_rows(data: dict[str, Any]) -> Table:
    """The sharded mode against FSDP2 (results written before it was measured have none)."""
    results = data["results"]
    if not all("fsdp_ratio_median" in r for r in results.values()):
        return []
    rows = [
        (
            case,
            f"{r['epoch_seconds_fsdp']:.3f}",
            f"{r['epoch_seconds_reproducible_fsdp']:.3f}",
            f"{_x(r['fsdp_ratio_median'])} "
            f"({_x(r['fsdp_ratio_spread'][0])}-{_x(r['fsdp_ratio_spread'][1])})",
        )
        for case, r in results.items()
    ]
    lines = [
        "Sharded: FSDP2 against the mode with `strategy: fsdp` (an int64 reduce-scatter), the "
        "same runs:",
        "",
        *_table(["workload", "FSDP2 s", "mode (fsdp) s", "ratio (range)"], rows),
        "",
    ]
    if not all("mode_memory_bytes" in r for r in results.values()):
        return lines
    memory = [
        (
            f"{case}, {layout}",
            f"{m['gradients'] / 2**20:.2f}",
            f"{m['held'] / 2**20:.2f}",
            f"{m['planned'] / 2**20:.2f}",
            f"{m['held'] / m['planned']:.3f}" if m["planned"] else "-",
        )
        for case, r in results.items()
        for layout, m in r["mode_memory_bytes"].items()
    ]
    return [
        *lines,
        "The mode's memory per rank beyond the gradients: held after training against the "
        "memory plan's `reproducible mode` item (MiB):",
        "",
        *_table(["workload, layout", "gradients", "held", "planned", "held / planned"], memory),
        "",
    ]


def fault_tolerance(data: dict[str, Any]) -> Table:
    rows = [
        (
            schedule,
            *(
                f"{r[mode]['steps_per_minute']:.0f} ({r[mode]['wall_s']:.1f} s, "
                f"{r[mode]['kills']} kills)"
                for mode in ("fault_tolerant", "torchrun_restart")
            ),
        )
        for schedule, r in data["results"].items()
    ]
    return [
        f"One job ({data['steps']} steps, {data['workers']} workers, a checkpoint every "
        f"{data['checkpoint_every']} steps) under each kill schedule: committed steps per "
        "minute (the wall time to the last step, kills made):",
        "",
        *_table(["kill schedule", "fault tolerant (supervise)", "torchrun restart"], rows),
    ]


def fsdp_sharding(data: dict[str, Any]) -> Table:
    ddp, fsdp = data["results"]["ddp"], data["results"]["fsdp"]
    ratio = data["fsdp_over_ddp"]
    parts = [("parameters", "parameters_mb"), ("gradients", "gradients_mb")]
    parts.append(("Adam moments", "optimizer_mb"))
    rows = [
        (
            name,
            f"{ddp['state'][key]:.1f}",
            f"{fsdp['state'][key]:.1f}",
            _x(ratio["state_parts"][key]),
        )
        for name, key in parts
    ]
    rows.append(
        (
            "RSS over the baseline after setup",
            f"{ddp['rss_after_setup_over_baseline_mb']:.0f}",
            f"{fsdp['rss_after_setup_over_baseline_mb']:.0f}",
            _x(fsdp["rss_after_setup_over_baseline_mb"] / ddp["rss_after_setup_over_baseline_mb"]),
        )
    )
    rows.append(
        (
            "peak RSS over the baseline",
            f"{ddp['peak_rss_over_baseline_mb']:.0f}",
            f"{fsdp['peak_rss_over_baseline_mb']:.0f}",
            _x(ratio["peak_rss"]),
        )
    )
    rows.append(
        ("ms per step", _ms(ddp["step_s"] * 1e3), _ms(fsdp["step_s"] * 1e3), _x(ratio["step_time"]))
    )
    default = data.get("peak_rss_over_baseline_mb_mmap_threshold") or {}
    if default:
        rows.append(
            (
                "peak RSS over the baseline, MALLOC_MMAP_THRESHOLD_=131072",
                f"{default['ddp']:.0f}",
                f"{default['fsdp']:.0f}",
                _x(default["fsdp"] / default["ddp"]),
            )
        )
    ckpt = fsdp["checkpoints"]
    seconds = ckpt["seconds"]
    io_rows = [
        ("save", f"{seconds['sharded']:.2f}", f"{seconds['file']:.2f}"),
        ("load", f"{seconds['load_sharded']:.2f}", f"{seconds['load_file']:.2f}"),
    ]
    checksums = ckpt.get("checksums")
    checksum_lines = []
    if checksums is not None:
        checksum_lines = [
            "",
            "Checksums of the sharded folder (manifest.json): save "
            f"{seconds['sharded']:.2f} s with them, {seconds['sharded_unchecked']:.2f} s "
            f"through DCP's plain writer ({_x(checksums['save_with_over_without'])}); load "
            f"{seconds['load_sharded']:.2f} s verified, "
            f"{seconds['load_sharded_unverified']:.2f} s without the verification "
            f"({_x(checksums['load_with_over_without'])}); the verification alone "
            f"{checksums['verify_s']:.2f} s (each rank checks its share).",
        ]
    return [
        f"A model of {fsdp['parameters'] / 1e6:.1f}M parameters with Adam, 2 CPU ranks (gloo), "
        "per rank (MB unless stated):",
        "",
        *_table(["", "DDP", "FSDP2", "FSDP2 / DDP"], rows),
        "",
        f"Training state per rank, FSDP2 over DDP: {_x(ratio['state_per_rank'])}.",
        "",
        f"FSDP2 checkpoints of the same run ({ckpt['single_file_mb']:.0f} MB as one file), "
        "seconds:",
        "",
        *_table(["", "sharded folder (every rank)", "one file (gathered to rank 0)"], io_rows),
        *checksum_lines,
        "",
        "Asynchronous sharded save, as a fraction of a synchronous sharded save: back to "
        f"training after {ckpt['async_return_fraction_of_sync_save']:.0%} of it"
        + (
            f" (the first save, which allocates the buffers kept between saves: "
            f"{ckpt['first_async_return_s']:.3f} s)"
            if "first_async_return_s" in ckpt
            else ""
        )
        + "; the next "
        f"epoch took {ckpt['async_stall_s']:+.3f} s longer than one without a save in the "
        f"background ({ckpt['async_stall_fraction_of_sync_save']:+.0%}).",
    ]


def _ci(summary: dict[str, Any]) -> str:
    return f"{_x(summary['ratio_median'])} [{_spread(summary['ratio_ci95'])}]"


def realistic(data: dict[str, Any]) -> Table:
    lines: Table = [
        "Per workload: median ms per step, minor page faults per step, and the median of the "
        "per-repetition ratios to the raw loop and to Fabric [95% interval of the median].",
        "",
    ]
    for result in data["results"]:
        world = result["world_size"]
        title = f"**{result['workload']}, {world} {'process' if world == 1 else 'ranks'}**"
        if "variants" in result:
            lines += [
                f"{title} ({result['steps_per_epoch']} steps x batch {result['batch_per_rank']}"
                f" per rank, {result['repetitions']} repetitions)",
                "",
                *_table(
                    ["variant", "ms/step", "faults/step", "vs raw", "vs Fabric"],
                    [
                        (
                            name,
                            _ms(row["ms_per_step"]),
                            f"{row['faults_per_step']:.0f}",
                            _ci(row["vs_raw"]),
                            _ci(row["vs_fabric"]),
                        )
                        for name, row in result["variants"].items()
                    ],
                ),
                "",
            ]
        elif "ms_per_call" in result:
            calls = result["ms_per_call"]
            low, high = result["extra_ms_per_call_ci95"]
            lines += [
                f"{title}: {result['samples']} samples, {result['batches_per_rank']} batches per "
                f"rank, {result['repetitions']} repetitions: hand-written {_ms(calls['raw'])} "
                f"ms, NNHandler.evaluate {_ms(calls['nn_handler'])} ms per call: "
                f"{_ci(result['vs_raw'])}, {result['extra_ms_per_call']:+.2f} ms per call "
                f"[{low:+.2f} to {high:+.2f}].",
                "",
            ]
        elif "ms_after_last_step" in result:
            after, ci = result["ms_after_last_step"], result["ms_after_last_step_ci95"]
            lines += [
                f"{title}: from the end of the last step to the epoch's end, "
                f"{result['repetitions']} epochs: raw {after['raw']:.3f} ms "
                f"[{_spread(ci['raw'])}], NNHandler {after['nn_handler']:.3f} ms "
                f"[{_spread(ci['nn_handler'])}].",
                "",
            ]
        else:
            startup, peak = result["startup_ms"], result["peak_rss_mb"]
            lines += [
                f"{title}, fresh processes, {result['repetitions']} repetitions:",
                "",
                *_table(
                    ["variant", "startup to first step, ms", "peak RSS per rank, MB"],
                    [(n, f"{startup[n]:.0f}", f"{peak[n]:.0f}") for n in startup],
                ),
                "",
                f"NNHandler's startup {_ci(result['startup_vs_raw'])} raw's, "
                f"{_ci(result['startup_vs_fabric'])} Fabric's; peak RSS "
                f"{_x(result['peak_rss_vs_raw'])} raw's, {_x(result['peak_rss_vs_fabric'])} "
                f"Fabric's.",
                "",
            ]
    return lines


RENDERERS: dict[str, Callable[[dict[str, Any]], Table]] = {
    "training_step": training_step,
    "object_collectives": object_collectives,
    "communicator_overhead": communicator_overhead,
    "loader_cache": loader_cache,
    "ema_update": ema_update,
    "checkpoint_io": checkpoint_io,
    "object_store_checkpoints": object_store_checkpoints,
    "async_saves": async_saves,
    "scaling": scaling,
    "fsdp_sharding": fsdp_sharding,
    "reproducible": reproducible,
    "fault_tolerance": fault_tolerance,
    "memory_plan": memory_plan,
    "realistic": realistic,
}


def _value(value: float, unit: str) -> str:
    return f"{value:+.3f} ms" if unit == "ms" else _x(value)


def _target_line(target: str, ok: bool, evidence: dict[str, Any] | None) -> str:
    line = f"- {'met' if ok else '**NOT MET**'}: {target}"
    if evidence is None:
        return line
    unit, (low, high) = evidence["unit"], evidence["ci95"]
    line += (
        f" (median {_value(evidence['median'], unit)}, 95% interval of the median "
        f"{_value(low, unit)} to {_value(high, unit)})"
    )
    if low <= evidence["bound"] <= high:
        line += "; undecidable: the bound lies inside the interval, this run cannot tell them apart"
    return line


def _targets(data: dict[str, Any]) -> Table:
    met = data.get("targets_met") or {}
    if not met:
        return []
    evidence = data.get("target_evidence") or {}
    return [
        "",
        "Targets:",
        "",
        *[_target_line(target, ok, evidence.get(target)) for target, ok in met.items()],
    ]


def render(results: dict[str, dict[str, Any]], command: str, folder: str) -> str:
    """The RESULTS.md text for ``results`` (benchmark name -> its JSON)."""
    first = next(iter(results.values()))
    facts = first["machine"]
    versions = ", ".join(
        f"{name} {facts[name]}"
        for name in ("python", "torch", "nn_handler", "lightning_fabric", "accelerate", "numpy")
        if facts.get(name)
    )
    dates = sorted(r.get("date", "") for r in results.values() if r.get("date"))
    lines = [
        "# Benchmark results",
        "",
        f"Generated by `{command}` from the JSON files in `{folder}/` "
        "(`benchmarks/report.py`); see `benchmarks/README.md` for what each benchmark does and "
        "how to read it.",
        "",
        f"- Machine: {facts['cpus']} CPU cores, {facts['platform']}"
        + (f", GPU {facts['gpu']}" if facts.get("gpu") else ", no GPU"),
        f"- Versions: {versions}",
        f"- Runs: {dates[0]} to {dates[-1]}" if dates else "- Runs: (dates not recorded)",
        "",
    ]
    for name in ORDER:
        if name not in results:
            continue
        data = results[name]
        lines += [
            f"## {name}",
            "",
            f"`{data['command']}`",
            "",
            *RENDERERS[name](data),
            *_targets(data),
            "",
        ]
    return "\n".join(lines).rstrip() + "\n"


def shown(folder: Path) -> str:
    """``folder`` relative to the working directory when it is below it (stable in the page)."""
    try:
        return str(folder.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(folder)


def load(folder: Path) -> dict[str, dict[str, Any]]:
    """Every known benchmark's JSON in ``folder``, by name."""
    return {
        name: json.loads((folder / f"{name}.json").read_text())
        for name in ORDER
        if (folder / f"{name}.json").exists()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    here = Path(__file__).parent
    parser.add_argument("--results", type=Path, default=here / "results")
    parser.add_argument("--out", type=Path, default=here / "RESULTS.md")
    parser.add_argument("--command", default="make bench", help="the command to record")
    args = parser.parse_args()
    results = load(args.results)
    if not results:
        raise SystemExit(f"no benchmark results in {args.results}; run `make bench` first")
    args.out.write_text(render(results, args.command, shown(args.results)))
    print(f"wrote {args.out} ({len(results)} benchmarks)")


if __name__ == "__main__":
    main()
