"""`python -m bench.profile_reload` on a real vLLM CPU engine: it runs, and what docs/concepts.md
says bounds a CPU reload (oneDNN repacking of the linear layers, the loaders' copies) is what
the profile shows."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from testbed.vllm_server import REPO

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_profile_reload_names_what_the_reload_spends_its_time_on() -> None:
    run = subprocess.run(
        [sys.executable, "-m", "bench.profile_reload", "--quick", "--cores", "1", "--repeats", "2"],
        cwd=REPO,
        # Without the LD_PRELOAD that importing vLLM in this process (other test modules) set:
        # with libgomp preloaded, torch runs two threads on the one core.
        env={k: v for k, v in os.environ.items() if k != "LD_PRELOAD"},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    out = run.stdout
    summary = re.search(
        r"median ([\d.]+) s \(([\d,]+) MB/s\) over 2; torch threads 1, cores 1", out
    )
    assert summary, out
    assert float(summary.group(1)) > 0
    shares = {
        m.group(2): float(m.group(1))
        for m in re.finditer(r"^\s+([\d.]+)%\s+[\d.]+ s\s+\d+ calls\s+(.+?)\s+\(", out, re.M)
    }
    onednn = [v for k, v in shares.items() if "create_onednn_mm_handler" in k]
    copies = [v for k, v in shares.items() if "copy_" in k]
    assert onednn and copies, out
    # They are the two largest entries, and together a large part of the reload (about half
    # on this small model, three quarters on the bandwidth suite's 393 MB one).
    top_two = sorted(shares.values(), reverse=True)[:2]
    assert sorted([onednn[0], copies[0]], reverse=True) == top_two, out
    assert onednn[0] + copies[0] > 35, out
