"""The real `refit-operator` process, started the one way the tests, the benchmarks and the
demo start it.

    op = OperatorProcess.start(kubeconfig, namespace, log_path, identity="op0",
                               metrics_port=0, extra_args=[...])
    op.wait_until(ready, what="...")    # OperatorError (with the log's tail) if it exits first
    op.stop() / op.kill() / op.freeze() / op.thaw() / op.poll() / op.wait() / op.log_tail()

`OperatorProcess(args, log_path, env=...)` runs exact arguments (the chart tests run the
Deployment's own). Each process leads a process group of its own, so stopping it stops
whatever it started. `Operators` numbers replicas for one namespace (the cluster tests').

The operator runs at the chart's lease (its default, 15 s) unless a test is about leases:
a test whose replica must take over from a killed or frozen one (or a restarted process
from its predecessor) sets FAILOVER_LEASE_SECONDS, so that the takeover waits 3 s, not 15.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OPERATOR = Path(sys.executable).with_name("refit-operator")
# For tests about failover only (see the module docstring): a takeover waits one lease.
FAILOVER_LEASE_SECONDS = 3


class OperatorError(RuntimeError):
    """The operator exited, or was not ready in time; the message ends with its log's tail."""


def operator_command() -> list[str]:
    """The console script beside this interpreter (the virtualenv's), else the module."""
    return [str(OPERATOR)] if OPERATOR.exists() else [sys.executable, "-m", "refit_operator.main"]


def operator_args(
    kubeconfig: Path | str,
    namespace: str,
    *,
    identity: str,
    lease_namespace: str | None = None,
    lease_name: str | None = None,
    lease_seconds: int | None = None,
    metrics_port: int = 0,
    metrics_addr: str | None = None,
    extra_args: Sequence[str] = (),
) -> list[str]:
    """The command line for one namespace; the lease lives in that namespace unless told
    otherwise. None leaves the operator's default (lease name, lease seconds, metrics addr)."""
    args = ["--kubeconfig", str(kubeconfig), "--namespace", namespace,
            "--metrics-port", str(metrics_port),
            "--lease-namespace", lease_namespace or namespace, "--identity", identity]  # fmt: skip
    if metrics_addr is not None:
        args += ["--metrics-addr", metrics_addr]
    if lease_name is not None:
        args += ["--lease-name", lease_name]
    if lease_seconds is not None:
        args += ["--lease-seconds", str(lease_seconds)]
    return [*args, *extra_args]


class OperatorProcess:
    """One `refit-operator` process with these arguments, its output (stdout and stderr,
    unbuffered) in `log`. `env` is added to this process's environment; `wrap` goes before
    the command (a profiler: `py-spy record ... --`)."""

    def __init__(
        self,
        args: Sequence[str],
        log: Path,
        *,
        env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
        metrics_port: int = 0,
    ) -> None:
        self.args = list(args)
        self.log = log
        self.metrics_port = metrics_port
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*wrap, *operator_command(), *self.args],
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                cwd=REPO,
                start_new_session=True,
            )

    @classmethod
    def start(
        cls,
        kubeconfig: Path | str,
        namespace: str,
        log: Path,
        *,
        identity: str,
        lease_namespace: str | None = None,
        lease_name: str | None = None,
        lease_seconds: int | None = None,
        metrics_port: int = 0,
        metrics_addr: str | None = None,
        extra_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        wrap: Sequence[str] = (),
    ) -> OperatorProcess:
        """The operator watching `namespace` (see operator_args)."""
        args = operator_args(
            kubeconfig, namespace, identity=identity, lease_namespace=lease_namespace,
            lease_name=lease_name, lease_seconds=lease_seconds, metrics_port=metrics_port,
            metrics_addr=metrics_addr, extra_args=extra_args,
        )  # fmt: skip
        return cls(args, log, env=env, wrap=wrap, metrics_port=metrics_port)

    # --- the process -------------------------------------------------------------------------

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout: float | None = None) -> int:
        return self.proc.wait(timeout=timeout)

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return "(no log)"

    def wait_until(
        self,
        ready: Callable[[], bool],
        *,
        timeout: float = 60.0,
        what: str = "ready",
        interval: float = 0.2,
    ) -> None:
        """Poll `ready()` until it is true. OperatorError with the log's tail when the process
        exits first or `timeout` seconds pass (the process is left as it is)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.poll() is not None:
                raise OperatorError(f"the operator exited {self.returncode}:\n{self.log_tail()}")
            if ready():
                return
            if time.monotonic() > deadline:
                raise OperatorError(
                    f"the operator was not {what} after {timeout:.0f}s:\n{self.log_tail()}"
                )
            time.sleep(interval)

    def wait_metrics(self, *, timeout: float = 60.0, addr: str = "127.0.0.1") -> None:
        """Until its /metrics answers (started with a metrics port)."""
        if not self.metrics_port:
            raise ValueError("started without a metrics port")
        url = f"http://{addr}:{self.metrics_port}/metrics"

        def answers() -> bool:
            with contextlib.suppress(OSError):  # refused, reset, HTTP errors while starting
                with urllib.request.urlopen(url, timeout=2.0) as r:
                    return bool(r.status == 200)
            return False

        self.wait_until(answers, timeout=timeout, what="serving /metrics", interval=0.3)

    # --- ending it ---------------------------------------------------------------------------

    def terminate(self) -> None:
        """SIGTERM to its process group (after SIGCONT: a frozen process could not stop)."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGCONT)
                os.killpg(self.pid, signal.SIGTERM)

    def wait_or_kill(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for it to exit, then SIGKILL its process group."""
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def stop(self, grace: float = 15.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds. Idempotent."""
        if self.poll() is None:
            self.terminate()
            self.wait_or_kill(grace)

    def kill(self) -> None:
        """SIGKILL to its process group: no chance to clean up, as when a node dies."""
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)
            self.proc.wait()

    def freeze(self) -> None:
        """SIGSTOP: the process stops between any two instructions, as in a long GC pause or
        CPU throttling, and carries on where it was on thaw()."""
        os.kill(self.pid, signal.SIGSTOP)

    def thaw(self) -> None:
        os.kill(self.pid, signal.SIGCONT)


@dataclass
class Operators:
    """Replicas of the operator for one namespace, numbered in start order: replica n has
    identity op<n> and its log in log_dir/operator-<n>.log; metrics off."""

    kubeconfig: Path
    namespace: str
    log_dir: Path
    lease_seconds: int | None = None  # None: the operator's default, the chart's lease
    procs: list[OperatorProcess] = field(default_factory=list)

    def start(self, *extra: str) -> OperatorProcess:
        n = len(self.procs)
        proc = OperatorProcess.start(
            self.kubeconfig, self.namespace, self.log_dir / f"operator-{n}.log",
            identity=f"op{n}", lease_seconds=self.lease_seconds, extra_args=extra,
        )  # fmt: skip
        self.procs.append(proc)
        return proc

    def kill(self, proc: OperatorProcess | None = None) -> None:
        """SIGKILL one replica (the last started when None)."""
        (proc or self.procs[-1]).kill()

    def freeze(self, proc: OperatorProcess) -> None:
        proc.freeze()

    def thaw(self, proc: OperatorProcess) -> None:
        proc.thaw()

    def stop_all(self) -> None:
        """SIGTERM to every replica at once, then SIGKILL to any still running after 10 s."""
        for proc in self.procs:
            proc.terminate()
        for proc in self.procs:
            proc.wait_or_kill(10)

    def logs(self) -> str:
        return "\n".join(
            p.read_text(errors="replace")[-4000:]
            for p in sorted(self.log_dir.glob("operator-*.log"))
        )
