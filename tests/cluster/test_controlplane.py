"""The test control plane itself: RBAC is enforced, ServiceAccount identities work, and every
way a run can end (stop, failed test, Ctrl-C, SIGTERM, SIGKILL, `make cluster-down`) leaves no
process and no listening port behind."""

from __future__ import annotations

import json
import os
import signal
import socket
import ssl
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from testbed.controlplane import REPO, ControlPlane, binaries, process_running

pytestmark = pytest.mark.cluster


def listening(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


def wait_gone(state: dict[str, Any], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(map(process_running, state["pids"].values())) and not any(
            map(listening, state["ports"].values())
        ):
            return
        time.sleep(0.1)
    alive = {n: p for n, p in state["pids"].items() if process_running(p)}
    open_ports = {n: p for n, p in state["ports"].items() if listening(p)}
    pytest.fail(f"left behind: processes {alive}, listening ports {open_ports}")


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), **extra}


# --- RBAC and ServiceAccounts -----------------------------------------------------------------


def test_admin_is_authenticated_by_token(control_plane: ControlPlane) -> None:
    who = json.loads(control_plane.kubectl("auth", "whoami", "-o", "json").stdout)
    assert who["status"]["userInfo"]["username"] == "admin"
    assert "system:masters" in who["status"]["userInfo"]["groups"]


def test_bad_token_and_anonymous_are_refused(control_plane: ControlPlane, tmp_path: Path) -> None:
    admin = yaml.safe_load(control_plane.kubeconfig.read_text())
    admin["users"][0]["user"] = {"token": "not-a-token"}
    bad = tmp_path / "bad.kubeconfig"
    bad.write_text(yaml.safe_dump(admin))
    proc = control_plane.kubectl("get", "namespaces", kubeconfig=bad, check=False)
    assert proc.returncode != 0 and "You must be logged in" in proc.stderr
    tls = ssl.create_default_context(cafile=control_plane.state_dir / "pki" / "ca.crt")
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"{control_plane.server}/api/v1/namespaces", context=tls)
    assert refused.value.code == 403
    assert 'User "system:anonymous" cannot list' in json.load(refused.value)["message"]


def test_service_account_without_permissions_is_refused(
    control_plane: ControlPlane, namespace: str
) -> None:
    kubeconfig = control_plane.as_service_account(namespace, "nobody")
    who = json.loads(
        control_plane.kubectl("auth", "whoami", "-o", "json", kubeconfig=kubeconfig).stdout
    )
    assert who["status"]["userInfo"]["username"] == f"system:serviceaccount:{namespace}:nobody"
    proc = control_plane.kubectl("get", "pods", "-n", namespace, kubeconfig=kubeconfig, check=False)
    assert proc.returncode != 0
    assert "Forbidden" in proc.stderr
    assert f"system:serviceaccount:{namespace}:nobody" in proc.stderr


def test_service_account_gets_exactly_what_its_role_grants(
    control_plane: ControlPlane, namespace: str
) -> None:
    kubeconfig = control_plane.as_service_account(namespace, "reader")
    control_plane.kubectl("create", "role", "read-pods", "-n", namespace, "--verb=get,list",
                          "--resource=pods")  # fmt: skip
    control_plane.kubectl("create", "rolebinding", "reader", "-n", namespace, "--role=read-pods",
                          f"--serviceaccount={namespace}:reader")  # fmt: skip
    listed = control_plane.kubectl("get", "pods", "-n", namespace, "-o", "json",
                                   kubeconfig=kubeconfig)  # fmt: skip
    assert json.loads(listed.stdout)["items"] == []
    create = control_plane.kubectl(
        "create", "configmap", "x", "-n", namespace, kubeconfig=kubeconfig, check=False
    )
    assert create.returncode != 0 and "forbidden" in create.stderr
    other = control_plane.kubectl(
        "get", "pods", "-n", "default", kubeconfig=kubeconfig, check=False
    )
    assert other.returncode != 0 and "forbidden" in other.stderr


def test_deleting_the_service_account_revokes_its_token(
    control_plane: ControlPlane, namespace: str
) -> None:
    # Not used before the deletion: the API server caches a successful token check ~10 s.
    kubeconfig = control_plane.as_service_account(namespace, "short-lived")
    control_plane.kubectl("delete", "serviceaccount", "short-lived", "-n", namespace)
    proc = control_plane.kubectl("auth", "whoami", kubeconfig=kubeconfig, check=False)
    assert proc.returncode != 0 and "You must be logged in" in proc.stderr


def test_namespace_fixture_gives_a_fresh_namespace(
    control_plane: ControlPlane, namespace: str
) -> None:
    assert namespace.startswith("test-namespace-fixture-gives")
    assert len(namespace) <= 63
    ns = json.loads(control_plane.kubectl("get", "namespace", namespace, "-o", "json").stdout)
    assert ns["status"]["phase"] == "Active"


# --- teardown -------------------------------------------------------------------------------

START_AND_REPORT = """
import json, sys
from pathlib import Path
from testbed.controlplane import ControlPlane
cp = ControlPlane(Path(sys.argv[1]))
cp.start()
print(json.dumps({"pids": cp.pids, "ports": cp.ports}), flush=True)
sys.stdin.readline()  # returns at EOF: then exit without cp.stop(), leaving it to atexit
"""


def start_child(tmp_path: Path) -> tuple[subprocess.Popen[str], dict[str, Any]]:
    child = subprocess.Popen(
        [sys.executable, "-c", START_AND_REPORT, str(tmp_path / "cp")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    assert child.stdout is not None
    line = child.stdout.readline()
    if not line:
        child.kill()
        pytest.fail(f"child exited {child.wait()} before the control plane was ready")
    state: dict[str, Any] = json.loads(line)
    assert all(map(process_running, state["pids"].values()))
    assert listening(state["ports"]["apiserver"]) and listening(state["ports"]["etcd"])
    return child, state


@pytest.mark.parametrize(
    "signum", [None, signal.SIGTERM, signal.SIGINT, signal.SIGKILL], ids=lambda s: str(s)
)
def test_owner_ending_tears_down(tmp_path: Path, signum: signal.Signals | None) -> None:
    child, state = start_child(tmp_path)
    assert child.stdin is not None
    try:
        if signum is None:
            child.stdin.close()
            assert child.wait(timeout=30) == 0
        else:
            child.send_signal(signum)
            assert child.wait(timeout=30) != 0
    finally:
        child.kill()
    wait_gone(state)


FAILING_TEST = """
import json, os
def test_fails(control_plane):
    with open(os.environ["STATE_FILE"], "w") as f:
        json.dump({"pids": control_plane.pids, "ports": control_plane.ports}, f)
    assert False, "deliberate"
"""


def test_failing_test_session_tears_down(tmp_path: Path) -> None:
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(FAILING_TEST))
    state_file = tmp_path / "state.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.fixtures.cluster",
         "-p", "no:cacheprovider", "--rootdir", str(tmp_path), str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, cwd=tmp_path, timeout=120,
        env=child_env(STATE_FILE=str(state_file)),
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "deliberate" in proc.stdout
    wait_gone(json.loads(state_file.read_text()), timeout=1.0)


def test_cli_up_is_idempotent_and_down_stops_it(tmp_path: Path) -> None:
    state_dir = tmp_path / "cluster"

    def cli(action: str) -> str:
        cmd = [sys.executable, "-m", "testbed.controlplane", action, "--state-dir",
               str(state_dir)]  # fmt: skip
        return subprocess.run(
            cmd, capture_output=True, text=True, check=True, env=child_env(), timeout=120
        ).stdout

    try:
        out = cli("up")
        assert f"export KUBECONFIG={state_dir / 'kubeconfig'}" in out
        state = json.loads((state_dir / "state.json").read_text())
        kubectl = [str(binaries() / "kubectl"), f"--kubeconfig={state_dir / 'kubeconfig'}"]
        subprocess.run([*kubectl, "get", "namespace", "default"], check=True, timeout=30)
        assert cli("up") == out  # already running: same cluster, nothing restarted
        assert json.loads((state_dir / "state.json").read_text()) == state
    finally:
        down = cli("down")
    assert down.strip() == "stopped"
    wait_gone(state, timeout=1.0)
    assert cli("down").strip() == "no control plane was running"


def test_missing_go_toolchain_is_one_clear_line(tmp_path: Path) -> None:
    path = os.pathsep.join(
        d for d in os.environ["PATH"].split(os.pathsep) if not (Path(d) / "go").exists()
    )
    proc = subprocess.run(
        [sys.executable, "-m", "testbed.controlplane", "up", "--state-dir",
         str(tmp_path / "cluster")],
        capture_output=True, text=True, env=child_env(PATH=path), timeout=60,
    )  # fmt: skip
    assert proc.returncode == 1
    assert proc.stderr.count("\n") == 1, proc.stderr
    assert "Go toolchain" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "cluster" / "state.json").exists()
