"""The test side's handles on simulated fleets: :class:`SimFleet` starts one simulator
subprocess (``python -m testbed.simworker``) serving n loopback addresses and drives its
control API; :class:`SimPod` is one of its pods. Kept apart from the rest of the package
(testbed.simworker does not import it): the subprocess starts faster without the client
side's imports.

Use (the tests' ``sim_fleet`` fixture starts a :class:`SimFleet` like this and closes it when
the test ends)
    async def test_x(sim_fleet):
        pods = sim_fleet(3, admin_token="t")  # SimFleet(3, admin_token="t").pods
        pods[1].set_fault("refit_load", "error", code="LoadFailed", times=1)
        async with refit_operator.edges.worker_client.session() as http:
            ... WorkerClient(pods[1].base_url, http=http, admin_token="t") ...
        assert pods[1].calls() == ["pause", "sleep", ...]

    ``set_fault(step, kind, value)`` sets a fault (the steps and kinds:
    testbed.simworker.pod). Besides faults: ``crash()``/``restart()`` a pod by hand;
    ``set_state(...)`` sets ``running``/``waiting`` (what /metrics reports),
    ``weight_version``, ``capabilities``, ``unsafe_reasons``, ``world_size``,
    ``tensor_parallel_size``, ``staging_budget``, ``max_lora_rank``,
    ``runtime_lora_updating``, ``drafter`` (the speculative method of a drafter the worker
    refits, with vLLM's spec-decode counters on /metrics); ``calls()`` lists the steps a pod
    served, in order
    (``call_log()`` with parameters, RPC bodies, fencing tokens, whether an
    ``Authorization`` header came (``auth``) and status codes; ``counts()`` per step);
    ``state()`` shows a pod's state (``staged``: the path and mode refit_stage holds, or
    None; ``adapters``: name -> path). The same methods on ``pods[0].fleet`` (the SimFleet)
    take ``pods=[...]`` and act on every pod when it is None.
"""

from __future__ import annotations

import ipaddress
import json
import os
import selectors
import subprocess
import sys
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from testbed.simworker.model import SIM_VOCAB


@dataclass(frozen=True)
class SimPod:
    ip: str
    port: int
    fleet: SimFleet = field(repr=False, compare=False)

    @property
    def base_url(self) -> str:
        return f"http://{self.ip}:{self.port}"

    def set_fault(
        self,
        step: str,
        kind: str,
        value: Any = None,
        *,
        code: str | None = None,
        times: int | None = None,
    ) -> None:
        self.fleet.set_fault(step, kind, value, code=code, times=times, pods=[self])

    def clear_faults(self, step: str | None = None) -> None:
        self.fleet.clear_faults(step, pods=[self])

    def crash(self, restart_after: float | None = None) -> None:
        self.fleet.crash([self], restart_after=restart_after)

    def restart(self) -> None:
        self.fleet.restart([self])

    def set_state(self, **values: Any) -> None:
        self.fleet.set_state([self], **values)

    def state(self) -> dict[str, Any]:
        return self.fleet.states([self])[self.ip]

    def call_log(self, *, clear: bool = False) -> list[dict[str, Any]]:
        return self.fleet.call_logs([self], clear=clear)[self.ip]

    def calls(self, *, clear: bool = False) -> list[str]:
        """The steps this pod served, in order (health and metrics included)."""
        return [c["step"] for c in self.call_log(clear=clear)]

    def counts(self) -> Counter[str]:
        return Counter(self.calls())


class SimFleet:
    """Handle on one simulator subprocess and its pods."""

    def __init__(
        self,
        n: int | None = None,
        *,
        ips: list[str] | None = None,
        admin_token: str | None = None,
        api_key: str | None = None,
        allowed_root: str | Path | None = None,
        vocab: int = SIM_VOCAB,
        port: int = 0,
        max_lora_rank: int = 0,
        runtime_lora_updating: bool = False,
        start_timeout: float = 60.0,
    ) -> None:
        """``max_lora_rank`` and ``runtime_lora_updating``: every pod's LoRA (vLLM's
        --max-lora-rank, 0 without --enable-lora, and VLLM_ALLOW_RUNTIME_LORA_UPDATING);
        off by default."""
        if ips is None:
            if n is None or n < 1:
                raise ValueError("give n >= 1 or ips")
            # Distinct addresses for every fleet of this test process.
            ips = loopback_ips(n, str(ipaddress.IPv4Address("127.1.0.1") + _take(n)))
        config = {
            "ips": ips,
            "admin_token": admin_token,
            "api_key": api_key,
            "allowed_root": str(allowed_root) if allowed_root else None,
            "vocab": vocab,
            "port": port,
            "max_lora_rank": max_lora_rank,
            "runtime_lora_updating": runtime_lora_updating,
        }
        root = Path(__file__).resolve().parents[2]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(root / "worker_image")])}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "testbed.simworker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            cwd=root,
            env=env,
            text=True,
        )
        try:
            assert self.proc.stdin is not None and self.proc.stdout is not None
            self.proc.stdin.write(json.dumps(config) + "\n")
            self.proc.stdin.flush()
            ready = _read_line(self.proc, start_timeout)
            self.port = int(ready["port"])
            self._control = httpx.Client(
                base_url=f"http://127.0.0.1:{ready['control_port']}", timeout=30.0
            )
        except BaseException:
            self.close()
            raise
        self.pods = [SimPod(ip, self.port, self) for ip in ips]

    def _post(self, action: str, pods: list[SimPod] | None, **doc: Any) -> Any:
        doc["ips"] = [p.ip for p in pods] if pods is not None else None
        response = self._control.post(f"/control/{action}", json=doc)
        if response.status_code != 200:
            raise ValueError(f"simworker control {action}: {response.text}")
        return response.json()

    def set_fault(
        self,
        step: str,
        kind: str,
        value: Any = None,
        *,
        code: str | None = None,
        times: int | None = None,
        pods: list[SimPod] | None = None,
    ) -> None:
        """Inject a fault on `step` of `pods` (all when None); see testbed.simworker.pod."""
        self._post("fault", pods, step=step, kind=kind, value=value, code=code, times=times)

    def clear_faults(self, step: str | None = None, *, pods: list[SimPod] | None = None) -> None:
        self._post("clear_faults", pods, step=step)

    def crash(
        self, pods: list[SimPod] | None = None, *, restart_after: float | None = None
    ) -> None:
        self._post("crash", pods, restart_after=restart_after)

    def restart(self, pods: list[SimPod] | None = None) -> None:
        self._post("restart", pods)

    def set_state(self, pods: list[SimPod] | None = None, **values: Any) -> None:
        self._post("state", pods, set=values)

    def states(self, pods: list[SimPod] | None = None) -> dict[str, dict[str, Any]]:
        result: dict[str, dict[str, Any]] = self._post("pods", pods)
        return result

    def call_logs(
        self, pods: list[SimPod] | None = None, *, clear: bool = False
    ) -> dict[str, list[dict[str, Any]]]:
        result: dict[str, list[dict[str, Any]]] = self._post("calls", pods, clear=clear)
        return result

    def close(self) -> None:
        if getattr(self, "_control", None) is not None:
            self._control.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


def loopback_ips(n: int, start: str = "127.1.0.1") -> list[str]:
    """n loopback addresses from `start` on, skipping .0 and .255 host parts."""
    ips: list[str] = []
    addr = ipaddress.IPv4Address(start)
    while len(ips) < n:
        if addr not in ipaddress.IPv4Network("127.0.0.0/8"):
            raise ValueError(f"ran out of loopback addresses after {len(ips)}")
        if addr.packed[3] not in (0, 255):
            ips.append(str(addr))
        addr += 1
    return ips


_ip_cursor = 0


def _take(n: int) -> int:
    """Reserve room for n addresses (plus skipped .0/.255) in this process's range."""
    global _ip_cursor
    start = _ip_cursor
    _ip_cursor += n + 2 * (n // 254 + 1) + 2
    return start


def _read_line(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout):
            raise TimeoutError(f"simworker did not start within {timeout}s")
    line = proc.stdout.readline()
    if not line:
        raise RuntimeError(f"simworker exited with {proc.wait()} before it listened")
    result: dict[str, Any] = json.loads(line)
    return result
