"""`python -m bench [--quick] [--only NAME ...]`: run suites, write bench/results/."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench.results import Metric, SuiteResult, loadavg, machine_info, write_result, write_table

RESULTS = Path(__file__).resolve().parent / "results"
SUITES = [
    "scale", "soak", "refit_vs_restart", "bandwidth", "probe_cost", "memory", "broadcast",
    "startup",
    "explorer", "under_load", "grpo", "parallel", "adapter", "overhead",
]  # fmt: skip
TITLES = {
    "scale": "control-plane scale (real API server + operator, simulated workers)",
    "soak": "a long RL run: consecutive refits on one fleet (real API server + operator)",
    "refit_vs_restart": "refit cycle vs vLLM restart (real vLLM CPU, tiny Llama)",
    "bandwidth": "reload bandwidth vs a raw sequential read of the same files",
    "probe_cost": "probe tokens and time per pod vs the refit cycle",
    "memory": "vLLM worker RSS across consecutive refits",
    "broadcast": "broadcast vs checkpoint refit (real vLLM CPU); the transport vs raw TCP",
    "startup": "vLLM imports and server starts with and without the venv's bytecode",
    "explorer": "the fault explorer's long mode: seeded schedules against the real Engine",
    "under_load": "refits under live traffic per drain mode vs the same refits idle (real vLLM)",
    "grpo": "TRL GRPO runs through Refit: each step's wait for its weights vs direct refits; "
    "async vs sync per step, fleet throughput during a Rolling keep refit",
    "parallel": "a tensor-parallel pod vs a one-worker pod: time out of traffic, staging memory",
    "adapter": "a LoRA adapter refit vs a full-weights refit, same pod, same run (real vLLM)",
    "overhead": "what the operator adds to a refit: operator-driven vs direct, same pods, one run",
}


def log(msg: str) -> None:
    print(f"[{datetime.now(UTC):%H:%M:%S}] {msg}", file=sys.stderr, flush=True)


def run_one(
    name: str,
    quick: bool,
    sizes: list[int] | None = None,
    scale_repeats: int = 3,
    large_timeout: float = 360.0,
    strategies: list[str] | None = None,
    profile: Path | None = None,
    soak_refits: int = 1000,
    soak_pods: int = 4,
    soak_history_limit: int = 10,
    lease_seconds: int = 15,
    group_size: int = 1,
    overhead_vllm_samples: int | None = None,
    overhead_vllm: bool = True,
) -> tuple[list[Metric], dict[str, Any], list[str]]:
    if name == "soak":
        from bench import soak

        refits = min(soak_refits, 60) if quick else soak_refits
        return soak.run_suite(refits, soak_pods, soak_history_limit, log, profile)
    if name == "scale":
        from bench import scale

        sizes = sizes or ([5, 20] if quick else [10, 100, 1000])
        repeats = {n: 1 if quick else scale_repeats for n in sizes}
        metrics, raw = scale.run_suite(
            sizes, repeats, log, large_timeout, strategies, profile, lease_seconds, group_size
        )
        notes = [f"failed run: {f}" for f in raw["failures"]]
        if group_size > 1:
            notes.append(
                f"pods in groups of {group_size} (spec.fleet.groups): each size counts pods, "
                f"the operator refits size / {group_size} groups through their leaders"
            )
        if lease_seconds != scale.LEASE_SECONDS:
            notes.append(
                f"the operator ran with --lease-seconds {lease_seconds}, not its default "
                f"{scale.LEASE_SECONDS}"
            )
        return metrics, raw, notes
    if name == "broadcast":
        from bench import broadcast

        return broadcast.suite(quick, log)
    if name == "startup":
        from bench import startup

        return startup.suite(quick, log)
    if name == "explorer":
        from bench import explorer

        return explorer.suite(quick, log)
    if name == "under_load":
        from bench import under_load

        return under_load.suite(quick, log)
    if name == "grpo":
        from bench import grpo

        return grpo.suite(quick, log)
    if name == "parallel":
        from bench import parallel

        return parallel.suite(quick, log)
    if name == "adapter":
        from bench import adapter

        return adapter.suite(quick, log)
    if name == "overhead":
        from bench import overhead

        return overhead.suite(quick, log, overhead_vllm_samples, overhead_vllm)
    from bench import vllm_suites

    runner: Callable[[bool, Callable[[str], None]], tuple[list[Metric], dict, list[str]]] = {
        "refit_vs_restart": vllm_suites.refit_vs_restart,
        "bandwidth": vllm_suites.bandwidth,
        "probe_cost": vllm_suites.probe_cost,
        "memory": vllm_suites.memory,
    }[name]
    return runner(quick, log)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes: checks the harness works")
    p.add_argument("--only", action="append", choices=SUITES, help="run only this suite")
    p.add_argument("--out", type=Path, default=RESULTS, help="default: bench/results")
    p.add_argument("--scale-sizes", type=int, nargs="+", help="fleet sizes of the scale suite")
    p.add_argument("--scale-repeats", type=int, default=3, help="runs per fleet size and strategy")
    p.add_argument(
        "--scale-timeout", type=float, default=360.0, help="seconds a run of > 100 pods may take"
    )
    p.add_argument(
        "--scale-strategies",
        nargs="+",
        choices=["AllAtOnce", "Rolling25"],
        help="strategies of the scale suite (default: both)",
    )
    p.add_argument(
        "--scale-profile",
        type=Path,
        metavar="DIR",
        help="run each operator under py-spy; collapsed stacks per run go to DIR",
    )
    p.add_argument(
        "--scale-lease-seconds",
        type=int,
        default=15,
        help="the operator's --lease-seconds in the scale suite (default: its default, 15)",
    )
    p.add_argument(
        "--scale-group-size",
        type=int,
        default=1,
        help="pods per LeaderWorkerSet-style group in the scale suite (default 1: no groups)",
    )
    p.add_argument("--soak-refits", type=int, default=1000, help="refits of the soak (--quick: 60)")
    p.add_argument("--soak-pods", type=int, default=4, help="simulated pods of the soak's fleet")
    p.add_argument(
        "--soak-history-limit",
        type=int,
        default=10,
        help="the operator's --history-limit in the soak (its default: 10)",
    )
    p.add_argument(
        "--overhead-vllm-samples",
        type=int,
        help="samples per side of the overhead suite's real-vLLM case (default 10, --quick 5)",
    )
    p.add_argument(
        "--overhead-no-vllm",
        action="store_true",
        help="the overhead suite's control-plane floor only (no vLLM server, no lock)",
    )
    p.add_argument(
        "--result-name",
        metavar="STEM",
        help="write the result to OUT/STEM.json instead of OUT/SUITE.json (one --only suite): "
        "a partial run, e.g. --scale-sizes 10000, then sits beside the full run in the table",
    )
    p.add_argument(
        "--reaggregate",
        action="store_true",
        help="rebuild the scale, soak and overhead results' metrics from their raw runs and "
        "rewrite the table; run nothing",
    )
    args = p.parse_args(argv)
    if args.result_name and len(args.only or SUITES) != 1:
        p.error("--result-name needs exactly one --only suite")
    if args.reaggregate:
        from bench import overhead, scale, soak

        for path in sorted(args.out.glob("*.json")):
            result = SuiteResult.from_json(json.loads(path.read_text()))
            if result.suite == "scale":
                runs = [scale.RunResult(**r) for r in result.raw["runs"]]
                result.metrics = scale.metrics_of(runs, sorted({r.pods for r in runs}))
            elif result.suite == "soak":
                run = soak.SoakRun.from_json(
                    {k: v for k, v in result.raw.items() if k not in soak.RAW_EXTRA}
                )
                result.metrics = soak.soak_metrics(run)
            elif result.suite == "overhead":
                result.metrics = overhead.metrics_of(result.raw)
            else:
                continue
            write_result(args.out, result, path.stem)
        log(f"table: {write_table(args.out, SUITES)}")
        return 0
    command = "python -m bench " + shlex.join(sys.argv[1:] if argv is None else argv)
    failed: list[str] = []
    for name in args.only or SUITES:
        machine = machine_info()
        date = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
        started = time.monotonic()
        log(f"{name}: start (load {machine['loadavg_before']})")
        try:
            metrics, raw, notes = run_one(
                name,
                args.quick,
                args.scale_sizes,
                args.scale_repeats,
                args.scale_timeout,
                args.scale_strategies,
                args.scale_profile,
                args.soak_refits,
                args.soak_pods,
                args.soak_history_limit,
                args.scale_lease_seconds,
                args.scale_group_size,
                args.overhead_vllm_samples,
                not args.overhead_no_vllm,
            )
        except Exception as e:  # one failed suite must not lose the others' results
            log(f"{name}: FAILED: {type(e).__name__}: {e}")
            failed.append(name)
            continue
        machine["loadavg_after"] = loadavg()
        raw["seconds"] = round(time.monotonic() - started, 1)
        result = SuiteResult(
            name, TITLES[name], command.strip(), date, machine, metrics, notes, raw
        )
        path = write_result(args.out, result, args.result_name)
        log(f"{name}: done in {raw['seconds']}s -> {path}")
    table = write_table(args.out, SUITES)
    log(f"table: {table}")
    if failed:
        log(f"failed suites: {', '.join(failed)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
