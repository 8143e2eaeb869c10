"""What the venv's bytecode buys: imports and vLLM CPU server starts with and without it.

`hack/venv.sh` compiles the venv once. With PYTHONDONTWRITEBYTECODE=1 (these machines and CI
set it) a venv without bytecode is compiled again, in memory, by every process that imports
vLLM. Both cases are measured in one run on the same venv: "without" points Python's
bytecode cache at an empty folder (PYTHONPYCACHEPREFIX) and forbids writing there, so each
process compiles every module it imports exactly as in a venv that holds no .pyc.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any

from bench.results import Metric
from testbed.tiny_model import ensure_tiny_model
from testbed.vllm_server import start_timeout, start_vllm_server

Log = Callable[[str], None]
SuiteOut = tuple[list[Metric], dict[str, Any], list[str]]
HOSTS = ["127.0.0.31", "127.0.0.32", "127.0.0.33"]  # three servers started together


def _env(compiled: bool, empty_cache: str) -> dict[str, str]:
    env = {"PYTHONDONTWRITEBYTECODE": "1"}
    if not compiled:
        env["PYTHONPYCACHEPREFIX"] = empty_cache
    return env


def import_seconds(env: dict[str, str]) -> float:
    """Wall seconds of a fresh `python -c "import vllm"`."""
    began = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", "import vllm"], check=True, capture_output=True,
        env={**os.environ, **env},
    )  # fmt: skip
    return time.perf_counter() - began


def servers_start_seconds(tiny: Any, hosts: list[str], env: dict[str, str], log: Log) -> float:
    """Wall seconds from starting ``len(hosts)`` servers together until every one answers
    /health (each server's own start is reported by its thread)."""
    errors: list[BaseException] = []
    ready = threading.Barrier(len(hosts) + 1)
    with ExitStack() as stack:

        def start(host: str) -> None:
            try:
                cm = start_vllm_server(
                    tiny, host=host, env=env, timeout=start_timeout(len(hosts)), progress=log
                )
                stack.enter_context(cm)
            except BaseException as e:  # reported after every thread ended
                errors.append(e)
            finally:
                ready.wait()

        began = time.perf_counter()
        threads = [threading.Thread(target=start, args=(h,), daemon=True) for h in hosts]
        for t in threads:
            t.start()
        ready.wait()
        seconds = time.perf_counter() - began
        for t in threads:
            t.join()
    if errors:
        raise RuntimeError(f"vLLM server(s) did not start: {errors[0]}")
    return seconds


def suite(quick: bool, log: Log) -> SuiteOut:
    tiny = ensure_tiny_model()
    imports = 2 if quick else 5
    starts = 1 if quick else 3
    raw: dict[str, Any] = {"import": {}, "one_server": {}, "three_servers": {}}
    with tempfile.TemporaryDirectory(prefix="refit-empty-pycache-") as empty:
        for compiled in (True, False):
            key = "compiled" if compiled else "uncompiled"
            env = _env(compiled, empty)
            # Interleaving the modes would let one warm the page cache for the other alike;
            # one warm-up import per mode instead, not counted.
            import_seconds(env)
            raw["import"][key] = [import_seconds(env) for _ in range(imports)]
            log(f"startup: import vllm {key}: {statistics.median(raw['import'][key]):.1f} s")
            raw["one_server"][key] = [
                servers_start_seconds(tiny, HOSTS[:1], env, log) for _ in range(starts)
            ]
            log(f"startup: one server {key}: {statistics.median(raw['one_server'][key]):.1f} s")
            raw["three_servers"][key] = [servers_start_seconds(tiny, HOSTS, env, log)]
            log(f"startup: three servers {key}: {raw['three_servers'][key][0]:.1f} s")
    metrics = []
    titles = {
        "import": 'cold `python -c "import vllm"`',
        "one_server": "one vLLM CPU server, start to /health",
        "three_servers": "three vLLM CPU servers started together, to /health",
    }
    for what, title in titles.items():
        c, u = raw[what]["compiled"], raw[what]["uncompiled"]
        metrics.append(Metric(f"{title}: venv compiled", c, "s"))
        metrics.append(Metric(f"{title}: no bytecode", u, "s"))
        metrics.append(
            Metric(
                f"{title}: no bytecode / compiled",
                [statistics.median(u) / statistics.median(c)],
                "x",
                note="ratio of the medians, both measured in this run",
            )
        )
    notes = [
        "no bytecode: PYTHONPYCACHEPREFIX=<empty folder> with PYTHONDONTWRITEBYTECODE=1, so "
        "every process (API server, engine core, worker) compiles what it imports, as in a "
        "venv installed without bytecode",
        f"start timeout: testbed.vllm_server.start_timeout(n) = REFIT_VLLM_START_TIMEOUT × n "
        f"({start_timeout(1):.0f} s per server)",
    ]
    return metrics, raw, notes
