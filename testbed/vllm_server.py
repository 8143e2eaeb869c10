"""Real vLLM CPU servers serving the tiny model (testbed/tiny_model.py), running the
refit_worker plugin, the admin guard and the worker extension on loopback.

    start_vllm_server(model)  context manager -> VllmServer (.base_url, .admin_token, .stop())

The tests' fixtures `tiny_model` and `vllm_server` (tests/fixtures/vllm.py) wrap it.

Each server is its own process group, killed at exit whatever happened. While a server
starts, its progress (elapsed time and the last step the server logged: its last INFO record,
not its warnings) is printed every PROGRESS_EVERY seconds: a slow start is never a failure by
itself. A server fails at once, with its log tail, when its process exits (an import error, a
bad argument) or its port is taken; only a server still silent after the start timeout fails
for time.

The start timeout is one knob, REFIT_VLLM_START_TIMEOUT (seconds for one server, default
240), scaled by the number of servers started together (`start_timeout(n)`): on a 2-core
machine three servers importing vLLM at once take about three times as long as one.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from testbed.tiny_model import TinyModel

REPO = Path(__file__).resolve().parents[1]
START_TIMEOUT = float(os.environ.get("REFIT_VLLM_START_TIMEOUT", "240"))
PROGRESS_EVERY = 30.0  # seconds between "still starting" lines, as the control-plane build
# One record of vLLM's own log format (vllm/logger.py _FORMAT): "(APIServer pid=7) INFO 12-07
# 03:00:00 [api_server.py:12] message"; the process prefix is absent in older versions.
VLLM_RECORD = re.compile(
    r"^(?:\(\S+ pid=\d+\) )?(?P<level>DEBUG|INFO|WARNING|ERROR|CRITICAL) "
    r"\d\d-\d\d \d\d:\d\d:\d\d \[[^\]]*\] (?P<message>.*)$"
)
PROGRESS_CHARS = 120  # a progress line's message is cut at its end beyond this
SERVED_MODEL = "tiny"
GUARD = "refit_worker.guard.AdminGuard"
EXTENSION = "refit_worker.extension.RefitWorkerExtension"

ENGINE_NICENESS = 10  # see start_vllm_server
# Offline (no hub), no telemetry, the dev-mode routes the refit flow uses, a 1 GiB KV cache.
ENGINE_ENV = {
    "VLLM_SERVER_DEV_MODE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


def cpu_runs_fp8_kv_cache() -> bool:
    """Whether vLLM's CPU attention accepts ``--kv-cache-dtype fp8`` on this machine. It asks
    torch the same two questions vLLM 0.32 asks (``v1/attention/backends/cpu_attn.py``,
    ``_get_attn_isa``): without AVX-512 or AMX the engine stops at start with "FP8 KV cache
    on CPU requires x86 with AVX-512 or AMX." (seen on an AMD EPYC without AVX-512)."""
    import torch

    return bool(torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported())


def engine_args(
    model: Path, tokenizer: Path, host: str, port: int, load_format: str = "dummy"
) -> list[str]:
    """The arguments after `python` that start vLLM's API server on the tiny model with the
    admin guard and the worker extension: one command line for the loopback servers here
    and the real node's pods (testbed/node_workloads.py)."""
    return [
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        "--model",
        str(model),
        "--tokenizer",
        str(tokenizer),
        "--served-model-name",
        SERVED_MODEL,
        "--host",
        host,
        "--port",
        str(port),
        "--load-format",
        load_format,
        "--dtype",
        "float32",
        "--max-model-len",
        "512",
        "--max-num-seqs",
        "8",
        "--enforce-eager",
        "--middleware",
        GUARD,
        "--worker-extension-cls",
        EXTENSION,
    ]


def lower_session_priority(pid: int, niceness: int) -> None:
    """Give the session that ``pid`` leads the niceness its processes have. With the
    kernel's autogroups (/proc/sys/kernel/sched_autogroup_enabled, 1 on these machines) CPU
    time is shared between sessions before nice values count, and a server runs in a session
    of its own (start_new_session): nice alone left it an equal share, and a 32-sample
    generation on one engine slowed a CPU-bound process elsewhere 16-fold (0.77 s to 12.2 s)
    and an operator's lease renewal to 16 s. No autogroups (or no permission): nice alone."""
    with contextlib.suppress(OSError):
        Path(f"/proc/{pid}/autogroup").write_text(str(niceness))


def start_timeout(together: int = 1) -> float:
    """Seconds to wait for /health when ``together`` servers start at once: the knob
    REFIT_VLLM_START_TIMEOUT is for one server, and servers starting together share the CPUs."""
    return START_TIMEOUT * max(1, together)


class PortTaken(OSError):
    """The server's port is already bound on its address: it would never answer."""


def check_port_free(host: str, port: int) -> None:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise PortTaken(f"port {port} on {host} is taken ({exc.strerror})") from exc


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def last_progress(path: Path) -> str:
    """What the server last said it did: the message of its last INFO record, shortened at
    its end ("" before it logged one). Warnings are not progress (vLLM advises raising the
    fd limit on every start, and a line cut to fit looked like a step), nor are tracebacks
    or other libraries' output: a start that fails prints the whole log tail instead."""
    for line in reversed(log_tail(path, 400).splitlines()):
        record = VLLM_RECORD.match(line.strip())
        if record and record["level"] == "INFO" and record["message"].strip():
            message = " ".join(record["message"].split())
            if len(message) > PROGRESS_CHARS:
                message = message[: PROGRESS_CHARS - 1] + "…"
            return message
    return ""


def log_tail(path: Path, lines: int = 60) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(no log: {exc})"


@dataclass
class VllmServer:
    host: str
    port: int
    admin_token: str
    api_key: str | None
    log_path: Path
    process: subprocess.Popen[bytes]
    started_seconds: float = 0.0
    stopped: bool = False  # stop() was called: an exit since then is not a crash
    _workdir: tempfile.TemporaryDirectory[str] | None = field(default=None, repr=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def model(self) -> str:
        return SERVED_MODEL

    def admin_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.admin_token}"}

    def api_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def log_tail(self, lines: int = 60) -> str:
        return log_tail(self.log_path, lines)

    def processes(self) -> list[tuple[str, Any]]:
        """(title, psutil.Process) of the server and every process it started; the title is
        the process's own (APIServer's executable, VLLM::EngineCore, VLLM::Worker, ...)."""
        import psutil

        try:
            root = psutil.Process(self.process.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return []
        out = []
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess):
                title = " ".join(p.cmdline()[:1]) or p.name()
                out.append((title.rsplit("/", 1)[-1], p))
        return out

    def rss_by_process(self) -> dict[str, int]:
        """Resident memory of the server and every process it started, by process title and
        pid (shared pages count in each)."""
        import psutil

        out: dict[str, int] = {}
        for title, p in self.processes():
            with contextlib.suppress(psutil.NoSuchProcess):
                out[f"{title}[{p.pid}]"] = p.memory_info().rss
        return out

    def rss_bytes(self) -> int:
        return sum(self.rss_by_process().values())

    def stop(self) -> None:
        self.stopped = True
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=10)
        # Children that outlived the leader (engine core) share its process group.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        if self._workdir is not None:
            self._workdir.cleanup()
            self._workdir = None

    # --- small helpers the tests share ---
    def rpc(self, client: httpx.Client, method: str, *args: Any, timeout: float = 120) -> Any:
        r = client.post(
            f"{self.base_url}/collective_rpc",
            json={"method": method, "args": list(args)},
            headers=self.admin_headers(),
            timeout=timeout,
        )
        r.raise_for_status()
        return r.json()["results"][0]

    def prompt_logprobs(self, client: httpx.Client, token_ids: list[int]) -> list[float | None]:
        r = client.post(
            f"{self.base_url}/v1/completions",
            json={
                "model": SERVED_MODEL,
                "prompt": token_ids,
                "max_tokens": 1,
                "temperature": 0,
                "prompt_logprobs": 0,
            },
            headers=self.api_headers(),
            timeout=60,
        )
        r.raise_for_status()
        entries = r.json()["choices"][0]["prompt_logprobs"]
        out: list[float | None] = [None]
        for tok, entry in zip(token_ids[1:], entries[1:], strict=True):
            out.append(float(entry[str(tok)]["logprob"]))
        return out


def _print_progress(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def wait_healthy(
    server: VllmServer,
    timeout: float,
    progress: Callable[[str], None] | None = _print_progress,
    every: float = PROGRESS_EVERY,
) -> None:
    """Wait for /health. Fails at once if the process exits; says every ``every`` seconds
    how long it has been starting and the last step it logged (``progress``; None: silent)."""
    began = time.monotonic()
    deadline = began + timeout
    next_say = began + every
    with httpx.Client() as client:
        while time.monotonic() < deadline:
            if server.process.poll() is not None:
                raise RuntimeError(
                    f"vLLM server on {server.base_url} exited with {server.process.returncode} "
                    f"before /health answered; log tail:\n{server.log_tail()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if client.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                    return
            now = time.monotonic()
            if progress is not None and now >= next_say:
                next_say = now + every
                last = last_progress(server.log_path)
                progress(
                    f"vLLM {server.host}:{server.port}: still starting ({now - began:.0f} s of "
                    f"{timeout:.0f} s); "
                    + (f"last step logged: {last}" if last else "nothing logged yet")
                )
            time.sleep(0.5)
    raise TimeoutError(
        f"vLLM server on {server.base_url} not healthy after {timeout:.0f} s "
        f"(REFIT_VLLM_START_TIMEOUT={START_TIMEOUT:.0f} s per server started together); "
        f"log tail:\n{server.log_tail()}"
    )


@contextlib.contextmanager
def start_vllm_server(
    tiny_model: TinyModel,
    *,
    host: str = "127.0.0.1",
    port: int | None = None,
    admin_token: str | None = None,
    api_key: str | None = None,
    load_format: str = "dummy",
    model_dir: Path | None = None,
    extra_args: list[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float | None = None,
    progress: Callable[[str], None] | None = _print_progress,
) -> Iterator[VllmServer]:
    """A real vLLM CPU server with the plugin, guard and extension.

    By default it starts from the tiny model's config with --load-format dummy (uniform
    logits) at weight version "default"; load_format="safetensors" with model_dir starts from
    a real checkpoint. admin_token="" writes an empty token file (the guard fails closed).
    `env` adds to (or overrides) the server's environment, e.g. vLLM's CPU binding knobs.
    `timeout` defaults to start_timeout(1); callers starting several servers at once pass
    start_timeout(n). `progress` receives the "still starting" lines (None: silent).
    """
    port = port or free_port(host)
    check_port_free(host, port)  # a taken port fails now, not after the start timeout
    workdir = tempfile.TemporaryDirectory(prefix="refit-vllm-")
    token = secrets.token_hex(16) if admin_token is None else admin_token
    token_file = Path(workdir.name) / "admin-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    # REFIT_VLLM_LOG_DIR keeps server logs after the run (CI artifacts, debugging).
    log_dir = Path(os.environ.get("REFIT_VLLM_LOG_DIR") or workdir.name)
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"vllm-{host}-{port}.log"
    model = model_dir or (tiny_model.base_dir if load_format == "dummy" else None)
    if model is None:
        raise ValueError("load_format other than dummy needs model_dir")
    server_env = {
        **os.environ,
        **ENGINE_ENV,
        "REFIT_ALLOWED_ROOT": str(tiny_model.allowed_root),
        "REFIT_ADMIN_TOKEN_FILE": str(token_file),
        "PYTHONPATH": os.pathsep.join(
            [str(REPO), str(REPO / "worker_image"), os.environ.get("PYTHONPATH", "")]
        ),
        **(env or {}),
    }
    cmd = [
        # Below the control plane in CPU priority: in a cluster the API server never shares
        # cores with the engines, and here two busy engines starved it (its watch cache fell
        # 120 revisions behind and a leader's renewal missed its deadline).
        *("nice", "-n", str(ENGINE_NICENESS)),
        sys.executable,
        *engine_args(model, tiny_model.base_dir, host, port, load_format),
        *(["--api-key", api_key] if api_key else []),
        *(extra_args or []),
    ]
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=server_env, start_new_session=True
        )
    lower_session_priority(process.pid, ENGINE_NICENESS)
    server = VllmServer(host, port, token, api_key, log_path, process, _workdir=workdir)
    try:
        started = time.monotonic()
        wait_healthy(server, start_timeout(1) if timeout is None else timeout, progress)
        server.started_seconds = time.monotonic() - started
        yield server
    finally:
        if process.poll() is not None and not server.stopped:  # it died: say why
            print(
                f"\nvLLM server {server.base_url} exited with {process.returncode}; "
                f"log tail:\n{server.log_tail()}",
                file=sys.stderr,
            )
        server.stop()


@contextlib.contextmanager
def start_vllm_pods(
    tiny_model: TinyModel, hosts: Sequence[str], **kwargs: Any
) -> Iterator[list[VllmServer]]:
    """One server per loopback address, all on one port: a fleet's pods, as the cluster tests
    register them (testbed.fleet.Fleet.add_server_pods). ``kwargs`` as for
    start_vllm_server, for every server; the start timeout allows for all of them."""
    port = free_port(hosts[0])
    kwargs.setdefault("timeout", start_timeout(len(hosts)))
    env = kwargs.pop("env", None) or {}
    with contextlib.ExitStack() as stack:
        yield [
            stack.enter_context(
                start_vllm_server(
                    tiny_model, host=host, port=port, env={**pod_cores(i), **env}, **kwargs
                )
            )
            for i, host in enumerate(hosts)
        ]


def pod_cores(index: int) -> dict[str, str]:
    """The i-th pod's worker on a core of its own, round robin over this machine's cores, as
    a node's cpusets give each pod its own. vLLM's CPU build otherwise binds every server's
    worker to the same core (its default binding takes the first cores and leaves one to the
    engine process), and two workers runnable on one core starved each other here: a worker
    stayed runnable with no CPU time for minutes (kernel 6.18, its vruntime far behind the
    other's) while its pod drained, so the requests it held made no progress and a wait
    drain stalled until DrainTimeout (tests/e2e/test_refit_under_load.py's broadcast test
    failed 3 runs of 5, clients timing out after 60 s). Measured apart (two servers, four
    streams of 200 tokens kept off the pod that pauses, /pause?mode=wait six times): on one
    shared core the second pause never answered in 400 s; with a core each the six took
    0.03 to 17 s, two above 10 s, so the wait still varies with what else the core runs."""
    cores = sorted(os.sched_getaffinity(0))
    return {"VLLM_CPU_OMP_THREADS_BIND": str(cores[index % len(cores)])}
