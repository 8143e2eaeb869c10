"""A real Prometheus (and promtool), from Debian's `prometheus` package.

hack/prometheus.sh installs the binaries into ~/.cache/refit/prometheus-<version>/ on first use:
`install()` returns their folder. `PrometheusServer(bin_dir, state_dir, targets, rule_files=...)`
is one Prometheus on a free loopback port scraping those targets (`start()`, `stop()`, queries).
The tests' fixtures (tests/fixtures/prometheus.py) wrap both.
"""

from __future__ import annotations

import atexit
import contextlib
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from testbed.controlplane import free_port, kill_group

ROOT = Path(__file__).resolve().parents[1]
INSTALL_SCRIPT = ROOT / "hack" / "prometheus.sh"


class PrometheusError(RuntimeError):
    """Prometheus could not be installed, started or queried; the message says why."""


def install() -> Path:
    """Folder holding prometheus and promtool; installs them on first use."""
    proc = subprocess.run(["bash", str(INSTALL_SCRIPT)], capture_output=True, text=True)
    if proc.returncode != 0:
        lines = [line for line in proc.stderr.splitlines() if line.strip()]
        raise PrometheusError(lines[-1] if lines else f"{INSTALL_SCRIPT} failed")
    return Path(proc.stdout.strip())


class PrometheusServer:
    """One Prometheus process on 127.0.0.1:<free port> with its own config and TSDB."""

    def __init__(
        self,
        bin_dir: Path,
        state_dir: Path,
        targets: Sequence[str],
        *,
        rule_files: Sequence[Path] = (),
        scrape_interval: str = "1s",
        evaluation_interval: str = "1s",
        job: str = "refit-operator",
    ) -> None:
        self.bin_dir = bin_dir
        self.state_dir = state_dir
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.job = job
        self.log_path = state_dir / "prometheus.log"
        self._proc: subprocess.Popen[bytes] | None = None
        state_dir.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {
                "scrape_interval": scrape_interval,
                "scrape_timeout": scrape_interval,
                "evaluation_interval": evaluation_interval,
            },
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [{"targets": list(targets)}]}],
        }
        self.config_path = state_dir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))

    def start(self, timeout: float = 30.0) -> None:
        log = self.log_path.open("wb")
        self._proc = subprocess.Popen(
            [
                str(self.bin_dir / "prometheus"),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.state_dir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--web.enable-lifecycle",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        log.close()
        atexit.register(self.stop)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise PrometheusError(f"prometheus exited {self._proc.returncode}: {self._tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{self.url}/-/ready", timeout=2).status_code == 200:
                    return
            time.sleep(0.2)
        self.stop()
        raise PrometheusError(f"prometheus not ready after {timeout:.0f}s: {self._tail()}")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            kill_group(self._proc.pid)
        self._proc = None

    def _tail(self, lines: int = 10) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return " | ".join(text.strip().splitlines()[-lines:])

    def _api(self, path: str, params: dict[str, Any]) -> Any:
        resp = httpx.get(f"{self.url}/api/v1/{path}", params=params, timeout=30)
        body = resp.json()
        if resp.status_code != 200 or body.get("status") != "success":
            raise PrometheusError(
                f"{path} {params}: HTTP {resp.status_code} {body.get('errorType')}: "
                f"{body.get('error')}"
            )
        return body["data"]

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        """Instant query; the vector (or a one-element list for a scalar)."""
        params: dict[str, Any] = {"query": expr}
        if at is not None:
            params["time"] = at
        data = self._api("query", params)
        if data["resultType"] in ("scalar", "string"):
            return [{"metric": {}, "value": data["result"]}]
        result: list[dict[str, Any]] = data["result"]
        return result

    def query_range(
        self, expr: str, start: float, end: float, step: float = 1.0
    ) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._api(
            "query_range", {"query": expr, "start": start, "end": end, "step": step}
        )["result"]
        return result

    def targets(self) -> list[dict[str, Any]]:
        active: list[dict[str, Any]] = self._api("targets", {})["activeTargets"]
        return active

    def rules(self) -> list[dict[str, Any]]:
        groups: list[dict[str, Any]] = self._api("rules", {})["groups"]
        return groups

    def wait_for(
        self, expr: str, *, timeout: float = 30.0, what: str | None = None
    ) -> list[dict[str, Any]]:
        """Poll an instant query until it returns data; the data."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if result:
                return result
            if time.monotonic() > deadline:
                raise PrometheusError(f"no data for {what or expr!r} after {timeout:.0f}s")
            time.sleep(0.5)

    def wait_scraped(self, *, scrapes: int = 2, timeout: float = 60.0) -> None:
        """Wait until every target has been scraped successfully `scrapes` times and is up."""
        self.wait_for(
            f'min(sum_over_time(up{{job="{self.job}"}}[10m])) >= {scrapes}'
            f' and min(up{{job="{self.job}"}}) == 1',
            timeout=timeout,
            what=f"{scrapes} successful scrapes of every target",
        )
