"""A real Kubernetes control plane (etcd + kube-apiserver) on loopback, for tests and CLI.

The binaries come from hack/build-control-plane.sh (built once, cached outside the repo).
The API server runs with RBAC authorization and token authentication, so code under test can
act as a ServiceAccount with exactly the RBAC a chart grants it.

Teardown is layered because a leaked apiserver holds ports and ~300 MB on a shared machine:
its owner stops it (the tests' fixture finalizer, the demo's and the benches' exit stacks);
an atexit hook and SIGTERM/SIGINT handlers stop whatever is still running; and unless
detached the children also get PR_SET_PDEATHSIG, so even a SIGKILLed owner (pytest, the
demo) takes them along. Each child runs in its own process group, killed as a group.

CLI (`make cluster` / `make cluster-down`):
    python -m testbed.controlplane up [--state-dir DIR]
    python -m testbed.controlplane down [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import base64
import contextlib
import ctypes
import datetime as dt
import ipaddress
import json
import os
import re
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from types import FrameType
from typing import Any

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "hack" / "build-control-plane.sh"
CRD_DIR = REPO / "crds"
WEIGHTREFIT_CRD = "weightrefits.refit.rollout.dev"


class ControlPlaneError(RuntimeError):
    """The control plane could not be built, started or used; the message says why."""


class KubectlError(ControlPlaneError):
    def __init__(self, args: tuple[str, ...], returncode: int, stderr: str) -> None:
        super().__init__(f"kubectl {' '.join(args)} exited {returncode}: {stderr.strip()}")
        self.returncode = returncode
        self.stderr = stderr


def cache_dir() -> Path:
    """The same cache root hack/build-control-plane.sh uses."""
    if root := os.environ.get("REFIT_CACHE"):
        return Path(root)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "refit"


def binaries(*, node: bool = False) -> Path:
    """Folder holding etcd, kube-apiserver and kubectl (and with `node`, kubelet,
    kube-controller-manager and kube-scheduler); builds them on first use. The build
    script's progress lines (a first build takes minutes) go to our stderr as they come; a
    failure is one error whose message is the script's last line."""
    proc = subprocess.Popen(
        ["bash", str(BUILD_SCRIPT), *(["--node"] if node else [])],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stderr is not None and proc.stdout is not None
    lines = []
    for line in proc.stderr:
        lines.append(line.rstrip())
        if "building" in line or "built in" in line:
            print(line.rstrip(), file=sys.stderr, flush=True)
    out = proc.stdout.read()
    if proc.wait() != 0:
        shown = [line for line in lines if line.strip()]
        raise ControlPlaneError(shown[-1] if shown else f"{BUILD_SCRIPT} failed")
    return Path(out.strip())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _pem(obj: Any) -> bytes:
    if isinstance(obj, x509.Certificate):
        return obj.public_bytes(serialization.Encoding.PEM)
    return bytes(
        obj.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )


def _issue(
    ca: x509.Certificate | None,
    ca_key: ec.EllipticCurvePrivateKey | None,
    name: x509.Name,
    *extensions: x509.ExtensionType,
) -> tuple[x509.Certificate, ec.EllipticCurvePrivateKey]:
    """A new EC P-256 key and its certificate, valid for 30 days, signed by ca (self-signed
    without one). P-256: generated in milliseconds, unlike RSA (time to ready)."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(ca.subject if ca is not None else name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=30))
    )
    for ext in extensions:
        builder = builder.add_extension(ext, critical=isinstance(ext, x509.BasicConstraints))
    return builder.sign(ca_key or key, hashes.SHA256()), key


def write_pki(pki: Path) -> None:
    """A throwaway CA; a serving cert for 127.0.0.1/localhost; the client cert kube-apiserver
    shows a kubelet (kubectl logs/exec on the real node, testbed/node.py); a ServiceAccount
    signing key."""
    pki.mkdir(parents=True, exist_ok=True)
    ca, ca_key = _issue(
        None,
        None,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "refit-test-ca")]),
        x509.BasicConstraints(ca=True, path_length=None),
    )
    sans: list[x509.GeneralName] = [
        x509.DNSName("localhost"),
        x509.DNSName("kubernetes.default.svc"),
        x509.IPAddress(ipaddress.ip_address("127.0.0.1")),
        x509.IPAddress(ipaddress.ip_address("10.0.0.1")),
    ]
    serving = _issue(
        ca,
        ca_key,
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver")]),
        x509.SubjectAlternativeName(sans),
    )
    kubelet_client = _issue(
        ca,
        ca_key,
        x509.Name(
            [
                x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:masters"),
                x509.NameAttribute(NameOID.COMMON_NAME, "kube-apiserver-kubelet-client"),
            ]
        ),
    )
    sa_key = ec.generate_private_key(ec.SECP256R1())
    (pki / "ca.crt").write_bytes(_pem(ca))
    for stem, (cert, key) in (("apiserver", serving), ("kubelet-client", kubelet_client)):
        (pki / f"{stem}.crt").write_bytes(_pem(cert))
        (pki / f"{stem}.key").write_bytes(_pem(key))
    (pki / "sa.key").write_bytes(_pem(sa_key))
    (pki / "sa.pub").write_bytes(
        sa_key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )


# Resolved before any fork: the child between fork and exec may not take the loader's locks.
_prctl = ctypes.CDLL(None, use_errno=True).prctl
_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """preexec_fn: SIGKILL this child when the thread that started it dies."""
    _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def process_running(pid: int) -> bool:
    """Alive and not a zombie. A zombie has already released its ports and memory, and an
    orphan's zombie waits for a PID 1 that may reap it only seconds later."""
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, os.WNOHANG)  # reap it if it is our own child
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def kill_group(pid: int, *, grace: float = 5.0, timeout: float = 10.0) -> None:
    """End the process group led by pid: SIGTERM, then SIGKILL after `grace` seconds
    (grace=0: SIGKILL at once). Returns when the leader is gone."""
    if grace > 0:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace
        while process_running(pid) and time.monotonic() < deadline:
            time.sleep(0.02)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while process_running(pid):
        if time.monotonic() > deadline:
            raise ControlPlaneError(f"process {pid} survived SIGKILL for {timeout:.0f}s")
        time.sleep(0.02)


class ControlPlane:
    """etcd + kube-apiserver on free loopback ports, state under state_dir.

    detached=False (tests, demo, benches): children die with this process.
    detached=True (`make cluster`): they outlive it, and `stop_recorded` ends them later from
    the pids in state.json.
    """

    def __init__(self, state_dir: Path, *, detached: bool = False) -> None:
        self.state_dir = state_dir
        self.detached = detached
        self.kubeconfig = state_dir / "kubeconfig"
        self.bin = Path()
        self.server = ""
        self.ports: dict[str, int] = {}
        self.pids: dict[str, int] = {}
        self._procs: list[subprocess.Popen[bytes]] = []
        self._admin_token = ""
        self.ready_seconds = 0.0  # last start(): from spawning etcd to /readyz answering 200

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, *, timeout: float = 60.0, attempts: int = 3) -> None:
        """Start and wait for /readyz. Retries with fresh ports if a child dies early
        (another process may grab a port between picking it and binding it)."""
        self.bin = binaries()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once(timeout)
                return
            except _EarlyExit:
                self.stop()
                if attempt == attempts:
                    raise
            except BaseException:
                self.stop()
                raise

    def _start_once(self, timeout: float) -> None:
        shutil.rmtree(self.state_dir / "etcd", ignore_errors=True)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        pki = self.state_dir / "pki"
        write_pki(pki)
        self.ports = {"etcd": free_port(), "etcd-peer": free_port(), "apiserver": free_port()}
        self.server = f"https://127.0.0.1:{self.ports['apiserver']}"
        self._admin_token = secrets.token_hex(16)
        (self.state_dir / "tokens.csv").write_text(
            f'{self._admin_token},admin,admin-uid,"system:masters"\n'
        )
        self.kubeconfig.write_text(self._kubeconfig("admin", self._admin_token))
        _register(self)
        spawned = time.monotonic()
        etcd_url = f"http://127.0.0.1:{self.ports['etcd']}"
        peer_url = f"http://127.0.0.1:{self.ports['etcd-peer']}"
        self._spawn(
            "etcd",
            [
                f"--data-dir={self.state_dir / 'etcd'}",
                f"--listen-client-urls={etcd_url}",
                f"--advertise-client-urls={etcd_url}",
                f"--listen-peer-urls={peer_url}",
                f"--initial-advertise-peer-urls={peer_url}",
                f"--initial-cluster=default={peer_url}",
                "--unsafe-no-fsync",
                "--log-level=warn",
            ],
        )
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers={etcd_url}",
                "--bind-address=127.0.0.1",
                "--advertise-address=127.0.0.1",
                f"--secure-port={self.ports['apiserver']}",
                f"--tls-cert-file={pki / 'apiserver.crt'}",
                f"--tls-private-key-file={pki / 'apiserver.key'}",
                "--service-cluster-ip-range=10.0.0.0/24",
                f"--service-account-issuer={self.server}",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--token-auth-file={self.state_dir / 'tokens.csv'}",
                "--authorization-mode=RBAC",
                "--disable-admission-plugins=ServiceAccount",
                "--allow-privileged=true",
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ],
        )
        self._wait_ready(timeout)
        self.ready_seconds = time.monotonic() - spawned
        (self.state_dir / "state.json").write_text(
            json.dumps({"server": self.server, "ports": self.ports, "pids": self.pids}, indent=1)
        )

    def _spawn(self, name: str, args: list[str]) -> None:
        log = open(self.state_dir / f"{name}.log", "wb")
        with log:
            proc = subprocess.Popen(
                [str(self.bin / name), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                # PDEATHSIG fires when the starting *thread* ends: only tie the children to
                # the main thread, whose end is the end of the process.
                preexec_fn=_die_with_parent if self._tied_to_process() else None,
            )
        self._procs.append(proc)
        self.pids[name] = proc.pid

    def _tied_to_process(self) -> bool:
        return not self.detached and threading.current_thread() is threading.main_thread()

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        tls = ssl.create_default_context(cafile=self.state_dir / "pki" / "ca.crt")
        readyz = urllib.request.Request(f"{self.server}/readyz", headers=self._auth_header())
        while True:
            for name, proc in zip(self.pids, self._procs, strict=True):
                if proc.poll() is not None:
                    raise _EarlyExit(
                        f"{name} exited with {proc.returncode} before the API server was "
                        f"ready:\n{self._log_tail(name)}"
                    )
            with contextlib.suppress(OSError):  # refused, reset, HTTP 500 while starting
                with urllib.request.urlopen(readyz, context=tls, timeout=2.0) as r:
                    if r.status == 200:
                        return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"kube-apiserver not ready after {timeout:.0f}s:\n"
                    f"{self._log_tail('kube-apiserver')}"
                )
            time.sleep(0.1)

    def _log_tail(self, name: str, lines: int = 15) -> str:
        log = self.state_dir / f"{name}.log"
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        """Idempotent. SIGKILL without grace: all state is disposable, and kube-apiserver's
        graceful shutdown takes seconds. The apiserver goes first, so it never sees etcd gone."""
        for proc in reversed(self._procs):
            kill_group(proc.pid, grace=0)
            proc.wait()
        self._procs.clear()
        self.pids.clear()
        _unregister(self)

    # --- acting on the cluster ---------------------------------------------------------------

    def _auth_header(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self._admin_token}"}

    def _kubeconfig(self, user: str, token: str) -> str:
        ca = base64.b64encode((self.state_dir / "pki" / "ca.crt").read_bytes()).decode()
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [
                {
                    "name": "refit",
                    "cluster": {"server": self.server, "certificate-authority-data": ca},
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": user, "context": {"cluster": "refit", "user": user}}],
            "current-context": user,
        }
        return yaml.safe_dump(config, sort_keys=False)

    def kubectl(
        self,
        *args: str,
        kubeconfig: Path | None = None,
        input: str | None = None,
        check: bool = True,
        timeout: float = 60.0,
    ) -> subprocess.CompletedProcess[str]:
        """Run kubectl against this control plane (as admin unless kubeconfig says otherwise).

        check=True raises KubectlError carrying stderr; check=False returns it for inspection.
        """
        cmd = [
            str(self.bin / "kubectl"),
            f"--kubeconfig={kubeconfig or self.kubeconfig}",
            # Our own discovery cache: ports get reused across runs, ~/.kube/cache would lie.
            f"--cache-dir={self.state_dir / 'kubectl-cache'}",
            *args,
        ]
        proc = subprocess.run(cmd, input=input, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise KubectlError(args, proc.returncode, proc.stderr)
        return proc

    def as_service_account(self, namespace: str, name: str, *, hours: int = 24) -> Path:
        """A kubeconfig that authenticates as ServiceAccount namespace/name (created if absent).

        Uses the TokenRequest API rather than the static token file: the token file is read once
        at start-up, so it could only hold identities known in advance, while TokenRequest
        mints a real bound ServiceAccount JWT for any account at any time, checked by the same
        authenticator (including the account still existing) that checks a pod's token.
        """
        sa = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": name}}
        self.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(sa))
        token = self.kubectl(
            "create", "token", name, "-n", namespace, f"--duration={hours}h"
        ).stdout.strip()
        path = self.state_dir / f"sa-{namespace}-{name}.kubeconfig"
        path.write_text(self._kubeconfig(f"system:serviceaccount:{namespace}:{name}", token))
        return path

    def create_namespace(self, prefix: str = "t") -> str:
        """A fresh namespace. Nothing deletes it: without kube-controller-manager a deleted
        namespace stays Terminating forever, and the whole etcd goes away with the session."""
        slug = re.sub(r"[^a-z0-9-]+", "-", prefix.lower()).strip("-")[:48].strip("-") or "t"
        name = f"{slug}-{secrets.token_hex(3)}"
        self.kubectl("create", "namespace", name)
        return name

    def install_crds(self, timeout: float = 30.0) -> None:
        """Apply crds/ and wait until the API server serves WeightRefit."""
        self.kubectl("apply", "--server-side", "-f", str(CRD_DIR))
        # Polled rather than `kubectl wait`: a CRD read before the API server wrote its first
        # status has no conditions, and kubectl wait then fails at once ("accessor error").
        established = "jsonpath={.status.conditions[?(@.type=='Established')].status}"
        deadline = time.monotonic() + timeout
        while True:
            got = self.kubectl("get", f"crd/{WEIGHTREFIT_CRD}", "-o", established, check=False)
            if got.returncode == 0 and got.stdout.strip() == "True":
                return
            if time.monotonic() > deadline:
                raise ControlPlaneError(
                    f"crd/{WEIGHTREFIT_CRD} not Established after {timeout}s: {got.stderr}"
                )
            time.sleep(0.2)


class _EarlyExit(ControlPlaneError):
    pass


# --- process-wide safety net -----------------------------------------------------------------

_live: list[ControlPlane] = []
_lock = threading.Lock()
_previous_handlers: dict[int, Any] = {}


def _register(cp: ControlPlane) -> None:
    if cp.detached:
        return
    with _lock:
        if not _live:
            atexit.unregister(_stop_all)
            atexit.register(_stop_all)
        if cp not in _live:
            _live.append(cp)
        # Signal handlers can only be set from the main thread.
        if not _previous_handlers and threading.current_thread() is threading.main_thread():
            for signum in (signal.SIGTERM, signal.SIGINT):
                _previous_handlers[signum] = signal.signal(signum, _on_signal)


def _unregister(cp: ControlPlane) -> None:
    with _lock:
        if cp in _live:
            _live.remove(cp)


def _stop_all() -> None:
    for cp in list(_live):
        cp.stop()


def _on_signal(signum: int, frame: FrameType | None) -> None:
    _stop_all()
    previous = _previous_handlers.get(signum)
    if callable(previous):
        previous(signum, frame)  # SIGINT: raises KeyboardInterrupt, so pytest still reports
    elif previous != signal.SIG_IGN:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


# --- CLI: make cluster / make cluster-down ---------------------------------------------------


def _cluster_dir(arg: str | None) -> Path:
    return Path(arg) if arg else cache_dir() / "cluster"


def runs(pid: int, binary: str) -> bool:
    """pid still runs binary (guards against killing a recycled pid; a zombie runs nothing)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0]
    except OSError:
        return False
    return cmdline.decode(errors="replace").endswith("/" + binary)


def stop_recorded(state_dir: Path) -> bool:
    """Stop a detached control plane from its state.json; True if anything was running."""
    state_file = state_dir / "state.json"
    if not state_file.exists():
        return False
    pids: dict[str, int] = json.loads(state_file.read_text())["pids"]
    running = [(name, pid) for name, pid in pids.items() if runs(pid, name)]
    for _, pid in sorted(running, key=lambda item: item[0] == "etcd"):
        kill_group(pid, grace=0)
    state_file.unlink()
    shutil.rmtree(state_dir / "etcd", ignore_errors=True)
    return bool(running)


def _print_access(cp_dir: Path) -> None:
    kubeconfig = cp_dir / "kubeconfig"
    server = json.loads((cp_dir / "state.json").read_text())["server"]
    print(f"control plane ready at {server}; kubeconfig: {kubeconfig}")
    print(f"export KUBECONFIG={kubeconfig}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.controlplane")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state-dir", help="default: ~/.cache/refit/cluster")
    args = parser.parse_args(argv)
    state_dir = _cluster_dir(args.state_dir)
    if args.action == "down":
        print("stopped" if stop_recorded(state_dir) else "no control plane was running")
        return 0
    state = state_dir / "state.json"
    if state.exists():
        pids: dict[str, int] = json.loads(state.read_text())["pids"]
        if all(runs(pid, name) for name, pid in pids.items()):
            _print_access(state_dir)
            return 0
        stop_recorded(state_dir)
    cp = ControlPlane(state_dir, detached=True)
    started = time.monotonic()
    try:
        cp.start()
    except ControlPlaneError as e:
        print(f"make cluster: {e}", file=sys.stderr)
        return 1
    print(
        f"started in {time.monotonic() - started:.1f}s "
        f"(processes ready in {cp.ready_seconds:.1f}s)",
        file=sys.stderr,
    )
    _print_access(state_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
