"""testbed/prometheus.py and hack/prometheus.sh: install, start, query, tear down."""

from __future__ import annotations

import socket
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from testbed.prometheus import INSTALL_SCRIPT, PrometheusError, PrometheusServer


def test_install_failure_is_one_clear_line(tmp_path: Path) -> None:
    proc = subprocess.run(
        ["/bin/bash", str(INSTALL_SCRIPT)],
        env={"PATH": str(tmp_path), "REFIT_CACHE": str(tmp_path / "cache")},
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert lines == [
        "prometheus.sh: needs apt-get and dpkg (Debian/Ubuntu) to fetch the prometheus package"
    ]
    assert not (tmp_path / "cache").exists()


def test_installed_binaries_run(prometheus_bin: Path) -> None:
    for binary in ("prometheus", "promtool"):
        proc = subprocess.run(
            [str(prometheus_bin / binary), "--version"], capture_output=True, text=True
        )
        assert proc.returncode == 0
        assert "version 2." in proc.stdout + proc.stderr


def test_server_scrapes_itself_and_is_torn_down(
    prometheus: Callable[..., PrometheusServer],
) -> None:
    first = prometheus([])
    # A second Prometheus scraping the first one: a target given by the test.
    second = prometheus([f"127.0.0.1:{first.port}"])
    second.wait_scraped(scrapes=2)
    assert second.query('up{job="refit-operator"}')[0]["value"][1] == "1"
    with pytest.raises(PrometheusError, match="bad_data"):
        second.query("sum(")
    second.stop()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", second.port)) != 0, "port still served after stop()"
    # stop() twice is harmless (the fixture stops everything again at teardown).
    second.stop()
