"""`python -m bench.profile_reload [--cores N] [--repeats N]`: where vLLM's reload spends its time.

Runs vLLM's engine in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0, so cProfile sees the
worker) on the bandwidth suite's wide checkpoint, times `reload_weights` from the page cache
N times, then profiles one more reload and prints the functions that took most of it, each
as a share of that reload. The bandwidth suite's note points here: the reload is CPU-bound
per-layer work (on the CPU platform, oneDNN repacking of every linear layer and the weight
loaders' copies), not I/O.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from typing import Any


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.profile_reload", description=__doc__)
    p.add_argument("--repeats", type=int, default=8, help="timed reloads before the profiled one")
    p.add_argument("--top", type=int, default=12, help="functions to list")
    p.add_argument("--quick", action="store_true", help="the bandwidth suite's small model")
    p.add_argument(
        "--cores",
        type=int,
        help="run on this many cores (default: all this process may use); 1 is what vLLM's "
        "default binding gives the server's worker on a 2-core machine",
    )
    args = p.parse_args(argv)
    if args.cores:
        allowed = sorted(os.sched_getaffinity(0))
        if not 0 < args.cores <= len(allowed):
            p.error(f"--cores must be between 1 and {len(allowed)}")
        cores = allowed[: args.cores]
        os.sched_setaffinity(0, cores)
        # vLLM's automatic CPU binding reads the machine's topology, not this affinity: name
        # the cores to it, with one torch thread each.
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
        os.environ["OMP_NUM_THREADS"] = str(args.cores)
    # Before vLLM is imported: one process, offline.
    os.environ.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CPU_KVCACHE_SPACE="1",
        HF_HUB_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
    )
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")  # vLLM logs every reload otherwise
    import torch
    from refit_worker import checkpoint
    from vllm import LLM

    from bench.vllm_suites import WIDE, WIDE_QUICK, wide_model
    from testbed.tiny_model import ensure_tiny_model

    wide = wide_model(ensure_tiny_model(), WIDE_QUICK if args.quick else WIDE)
    ckpt = str(wide.allowed_root / "W")
    size = sum(f.stat().st_size for f in checkpoint.safetensors_files(wide.allowed_root / "W"))
    llm = LLM(
        model=str(wide.base_dir),
        load_format="dummy",
        dtype="float32",
        max_model_len=512,
        max_num_seqs=8,
        enforce_eager=True,
    )
    llm.collective_rpc(
        "update_config", kwargs={"overrides": {"load_config": {"load_format": "safetensors"}}}
    )
    reload: dict[str, Any] = {"weights_path": ckpt, "is_checkpoint_format": True}
    llm.collective_rpc("reload_weights", kwargs=reload)  # first-load costs, page cache filled
    times = []
    for _ in range(args.repeats):
        began = time.perf_counter()
        llm.collective_rpc("reload_weights", kwargs=reload)
        times.append(time.perf_counter() - began)
    profile = cProfile.Profile()
    profile.enable()
    began = time.perf_counter()
    llm.collective_rpc("reload_weights", kwargs=reload)
    profiled = time.perf_counter() - began
    profile.disable()
    med = statistics.median(times)
    print(
        f"reload of {size / 1e6:.0f} MB from the page cache: median {med:.3f} s "
        f"({size / 1e6 / med:,.0f} MB/s) over {len(times)}; torch threads "
        f"{torch.get_num_threads()}, cores {len(os.sched_getaffinity(0))}"
    )
    print(f"profiled reload {profiled:.3f} s; functions by own time:")
    stats = pstats.Stats(profile)
    rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
    for (file, line, func), (_cc, calls, own, _cum, _callers) in rows[: args.top]:
        where = f"{os.path.basename(file)}:{line}" if line else file
        print(f"  {100 * own / profiled:5.1f}%  {own:.4f} s  {calls:5d} calls  {func}  ({where})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
