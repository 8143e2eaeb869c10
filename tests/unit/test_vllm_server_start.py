"""How the test bed waits for a vLLM server: a slow start says what it is doing and is not a
failure by itself; a process that exits or a taken port fails at once, with the reason.

A stand-in process plays the server here (an HTTP server that logs, then answers /health
late, or exits): the real servers' start is what tests/worker and tests/e2e exercise."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from testbed import vllm_server
from testbed.vllm_server import PortTaken, VllmServer, start_timeout, wait_healthy

# It logs as vLLM does (vllm/logger.py): a step, then the fd-limit warning vLLM writes on
# every start on a machine whose hard limit it cannot raise past, then a library's output.
SLOW_SERVER = textwrap.dedent(
    """
    import http.server, sys, time
    host, port, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    print("(APIServer pid=7) INFO 12-07 03:00:00 [weight_utils.py:12] INFO loading weights",
          flush=True)
    print("(APIServer pid=7) WARNING 12-07 03:00:01 [system_utils.py:255] Found ulimit of "
          "1024 and failed to automatically increase with error current limit exceeds "
          "maximum limit. This can cause fd limit errors like `OSError: [Errno 24] Too many "
          "open files`. Consider increasing with ulimit -n", flush=True)
    print("  warnings.warn(", flush=True)
    time.sleep(delay)
    print("INFO Application startup complete.", flush=True)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200); self.end_headers()
        def log_message(self, *a):
            pass
    http.server.HTTPServer((host, port), H).serve_forever()
    """
)


def _server(tmp_path: Path, script: str, *args: str) -> VllmServer:
    port = vllm_server.free_port("127.0.0.1")
    log = tmp_path / "server.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", script, "127.0.0.1", str(port), *args],
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    return VllmServer("127.0.0.1", port, "t", None, log, proc)


def test_a_slow_start_prints_progress_and_then_succeeds(tmp_path: Path) -> None:
    server = _server(tmp_path, SLOW_SERVER, "2.5")
    said: list[str] = []
    try:
        wait_healthy(server, timeout=60, progress=said.append, every=0.8)
    finally:
        server.process.kill()
        server.process.wait()
    assert said, "no progress while the server started"
    assert all("still starting" in line and "of 60 s" in line for line in said)
    # The last step it logged, its message alone; not the warning or the output after it.
    assert all(line.endswith("; last step logged: INFO loading weights") for line in said), said
    assert not any("ulimit" in line or "warn" in line for line in said), said


def test_progress_is_the_last_info_record_shortened_at_its_end(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert vllm_server.last_progress(log) == ""  # no log yet
    log.write_text("Traceback (most recent call last):\n  File x\n")
    assert vllm_server.last_progress(log) == ""  # nothing logged by vLLM itself
    long = "non-default args: " + "{'model': 'tiny', " * 20 + "}"
    log.write_text(
        f"INFO 12-07 03:00:00 [api_server.py:1] {long}\n"
        "(EngineCore_DP0 pid=9) WARNING 12-07 03:00:02 [cpu.py:3] Pin memory is not supported\n"
        "(EngineCore_DP0 pid=9) ERROR 12-07 03:00:03 [x.py:4] something the tail shows\n"
    )
    got = vllm_server.last_progress(log)
    assert got.startswith("non-default args: {'model': 'tiny',") and got.endswith("…")
    assert len(got) == vllm_server.PROGRESS_CHARS
    log.write_text(
        "(EngineCore_DP0 pid=9) INFO 12-07 03:00:04 [gpu_model_runner.py:5] "
        "Loading weights took 0.01 seconds\n"
    )
    assert vllm_server.last_progress(log) == "Loading weights took 0.01 seconds"


def test_a_server_that_logged_nothing_says_so(tmp_path: Path) -> None:
    script = "import time; time.sleep(30)"
    server = _server(tmp_path, script)
    said: list[str] = []
    try:
        with pytest.raises(TimeoutError):
            wait_healthy(server, timeout=2.0, progress=said.append, every=0.8)
    finally:
        server.process.kill()
        server.process.wait()
    assert said and all(line.endswith("; nothing logged yet") for line in said), said


def test_a_server_that_exits_fails_at_once_with_its_log(tmp_path: Path) -> None:
    script = "import sys; print('ImportError: no module named vllm_x', flush=True); sys.exit(3)"
    server = _server(tmp_path, script)
    began = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with 3") as err:
        wait_healthy(server, timeout=120, progress=None)
    assert time.monotonic() - began < 10
    assert "ImportError: no module named vllm_x" in str(err.value)


def test_silence_past_the_timeout_fails_with_the_knob_named(tmp_path: Path) -> None:
    server = _server(tmp_path, SLOW_SERVER, "30")
    try:
        with pytest.raises(TimeoutError, match="REFIT_VLLM_START_TIMEOUT") as err:
            wait_healthy(server, timeout=1.5, progress=None)
    finally:
        server.process.kill()
        server.process.wait()
    assert "INFO loading weights" in str(err.value)


def test_a_taken_port_fails_before_anything_starts() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        model: Any = object()  # never reached: the port is checked first
        with (
            pytest.raises(PortTaken, match=f"port {port} on 127.0.0.1 is taken"),
            vllm_server.start_vllm_server(model, host="127.0.0.1", port=port),
        ):
            pass


def test_the_start_timeout_scales_with_servers_started_together() -> None:
    one = start_timeout(1)
    assert one == vllm_server.START_TIMEOUT
    assert start_timeout(3) == 3 * one
    assert start_timeout(0) == one
