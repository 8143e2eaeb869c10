"""A real Kubernetes node on this machine: the test control plane (testbed/controlplane.py)
plus kube-controller-manager, kube-scheduler, containerd + runc and a kubelet, so Pods are
scheduled, run as containers, probed, restarted and garbage-collected for real.

    Node(state_dir).start()   control plane, containerd (images imported), controllers,
                              kubelet; returns when the node `refit-node` is Ready
    Node.stop()               pods gone, every process stopped, mounts, iptables rules and
                              the bridge removed

Parts and where they come from (hack/node/setup.sh fetches them; docs/node.md):
  kubelet, kube-controller-manager, kube-scheduler  tools/kube, the module that pins
      kube-apiserver (hack/build-control-plane.sh --node)
  containerd 2.x  Debian unstable's package, extracted under ~/.cache/refit/node/ (kubelet
      1.36 needs the CRI RuntimeConfig call, which bookworm's containerd 1.6 lacks)
  runc, CNI plugins (bridge, host-local, loopback), iptables  Debian bookworm packages
  images  testbed/node_images.py (Debian root filesystems, PyPI)

Networking: a CNI bridge (`refit0`, 10.244.0.0/24): every pod has its own IP, so several
vLLM pods listen on the same port. There is no kube-proxy: Service ClusterIPs do not route,
except the API server's (10.0.0.1:443), which one iptables DNAT rule sends to the
loopback-bound kube-apiserver (route_localnet), so pods' in-cluster config works.

Needs root. One node per machine (the bridge, iptables rules and cgroups are global):
a lock file says who holds it.

CLI:
    python -m testbed.node up [--state-dir DIR]     # detached; prints KUBECONFIG
    python -m testbed.node down [--state-dir DIR]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import fcntl
import json
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

from testbed.controlplane import (
    ControlPlane,
    ControlPlaneError,
    _die_with_parent,
    binaries,
    cache_dir,
    free_port,
    kill_group,
    process_running,
    runs,
)
from testbed.node_images import PAUSE_IMAGE, archive_path

REPO = Path(__file__).resolve().parents[1]
NODE_NAME = "refit-node"
BRIDGE = "refit0"
POD_SUBNET = "10.244.0.0/24"
API_SERVICE_IP = "10.0.0.1"  # the first address of controlplane.py's service range
CNI_BIN = Path("/usr/lib/cni")
RUNC = Path("/usr/sbin/runc")
NAT_CHAIN = "REFIT-NODE"
LOCK_FILE = Path("/run/refit-node.lock")


class NodeError(ControlPlaneError):
    pass


def containerd_bin() -> Path:
    """The folder holding containerd 2.x, containerd-shim-runc-v2 and ctr (hack/node/setup.sh)."""
    link = cache_dir() / "node" / "containerd" / "current"
    if not (link / "containerd").exists():
        raise NodeError(f"containerd 2.x not set up ({link}): run hack/node/setup.sh")
    return link.resolve()


def host_ip() -> str:
    """The node's InternalIP: the source address of the default route (kubelet refuses
    loopback)."""
    out = subprocess.run(
        ["ip", "-4", "-o", "route", "get", "1.1.1.1"], capture_output=True, text=True
    ).stdout.split()
    if "src" in out:
        return out[out.index("src") + 1]
    raise NodeError(f"no IPv4 default route to take the node IP from: {out}")


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise NodeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()}")
    return proc


class NodeControlPlane(ControlPlane):
    """controlplane.ControlPlane with the ServiceAccount admission plugin on (with
    kube-controller-manager creating each namespace's `default` ServiceAccount, pods get their
    projected token, kube-api-access-*, as on any cluster) and a client cert for the kubelet."""

    def _spawn(self, name: str, args: list[str]) -> None:
        if name == "kube-apiserver":
            pki = self.state_dir / "pki"
            args = [a for a in args if a != "--disable-admission-plugins=ServiceAccount"] + [
                # kubectl logs/exec/port-forward: the API server calls the kubelet with a
                # client cert of the CA the kubelet trusts (its serving cert is self-signed,
                # so it is not verified, as with kubeadm's defaults).
                f"--kubelet-client-certificate={pki / 'kubelet-client.crt'}",
                f"--kubelet-client-key={pki / 'kubelet-client.key'}",
                # The node's name resolves nowhere; its InternalIP is where the kubelet listens.
                "--kubelet-preferred-address-types=InternalIP",
            ]
        super()._spawn(name, args)


class Node:
    def __init__(self, state_dir: Path, *, detached: bool = False) -> None:
        self.state_dir = state_dir
        self.detached = detached
        self.cp = NodeControlPlane(state_dir / "controlplane", detached=detached)
        self.kubeconfig = self.cp.kubeconfig
        self.bin = Path()
        self.ctrd_bin = Path()
        self.sock = state_dir / "containerd" / "containerd.sock"
        self.pids: dict[str, int] = {}
        self._procs: dict[str, subprocess.Popen[bytes]] = {}
        self._lock: Any = None
        self._sysctl_saved: dict[str, str] = {}
        self.timings: dict[str, float] = {}

    # --- lifecycle ---------------------------------------------------------------------------

    def start(self, *, timeout: float = 180.0) -> None:
        if not self.detached:  # pods' containers outlive their kubelet: stop them at exit
            atexit.register(self.stop)
        try:
            self._start(timeout)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout: float) -> None:
        t0 = time.monotonic()
        self.bin = binaries(node=True)
        self.ctrd_bin = containerd_bin()
        images = archive_path()
        if not images.exists():
            raise NodeError(f"node images not built ({images}): run hack/node/setup.sh")
        self.timings["binaries"] = time.monotonic() - t0
        self._take_lock()
        shutil.rmtree(self.state_dir, ignore_errors=True)
        self.state_dir.mkdir(parents=True)
        t = time.monotonic()
        self.cp.start()
        self.cp.bin = self.bin
        self.timings["controlplane"] = time.monotonic() - t
        t = time.monotonic()
        self._network()
        self._containerd()
        self._import_images(images)
        self.timings["containerd+images"] = time.monotonic() - t
        t = time.monotonic()
        self._controllers()
        self._kubelet()
        self._wait_node_ready(timeout)
        self.timings["kubelet-ready"] = time.monotonic() - t
        self.timings["total"] = time.monotonic() - t0
        self._write_state()

    def _take_lock(self) -> None:
        LOCK_FILE.parent.mkdir(parents=True, exist_ok=True)
        f = LOCK_FILE.open("a+")
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            raise NodeError(
                f"another node runs on this machine ({LOCK_FILE}: {f.read()!r})"
            ) from None
        f.seek(0)
        f.truncate()
        f.write(f"{os.getpid()} {self.state_dir}\n")
        f.flush()
        self._lock = f

    def _spawn(
        self, name: str, exe: Path, args: list[str], env: dict[str, str] | None = None
    ) -> None:
        with open(self.state_dir / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [str(exe), *args],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
                preexec_fn=_die_with_parent
                if not self.detached and threading.current_thread() is threading.main_thread()
                else None,
            )
        self._procs[name] = proc
        self.pids[name] = proc.pid

    def log_tail(self, name: str, lines: int = 25) -> str:
        path = self.state_dir / f"{name}.log"
        with contextlib.suppress(OSError):
            return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def _check_alive(self) -> None:
        for name, proc in self._procs.items():
            if proc.poll() is not None:
                raise NodeError(f"{name} exited with {proc.returncode}:\n{self.log_tail(name)}")

    # --- parts -------------------------------------------------------------------------------

    def _network(self) -> None:
        """The API server's Service IP reaches the loopback-bound kube-apiserver from pods."""
        for key in ("net/ipv4/conf/all/route_localnet", "net/ipv4/ip_forward"):
            path = Path("/proc/sys") / key
            self._sysctl_saved[key] = path.read_text().strip()
            path.write_text("1")
        _remove_nat_rules()
        port = self.cp.ports["apiserver"]
        _sh("iptables", "-w", "-t", "nat", "-N", NAT_CHAIN)
        _sh(
            "iptables",
            "-w",
            "-t",
            "nat",
            "-A",
            NAT_CHAIN,
            "-d",
            f"{API_SERVICE_IP}/32",
            "-p",
            "tcp",
            "--dport",
            "443",
            "-j",
            "DNAT",
            "--to-destination",
            f"127.0.0.1:{port}",
        )
        _sh("iptables", "-w", "-t", "nat", "-I", "PREROUTING", "-j", NAT_CHAIN)
        _sh("iptables", "-w", "-t", "nat", "-I", "OUTPUT", "-j", NAT_CHAIN)
        cni = self.state_dir / "cni"
        (cni / "conf").mkdir(parents=True)
        (cni / "conf" / "10-refit.conflist").write_text(
            json.dumps(
                {
                    "cniVersion": "1.0.0",
                    "name": "refit",
                    "plugins": [
                        {
                            "type": "bridge",
                            "bridge": BRIDGE,
                            "isGateway": True,
                            "ipMasq": True,
                            "hairpinMode": True,
                            "ipam": {
                                "type": "host-local",
                                "ranges": [[{"subnet": POD_SUBNET}]],
                                "routes": [{"dst": "0.0.0.0/0"}],
                                "dataDir": str(cni / "ipam"),
                            },
                        },
                        {"type": "portmap", "capabilities": {"portMappings": True}},
                        {"type": "loopback"},
                    ],
                },
                indent=1,
            )
        )

    def _containerd(self) -> None:
        d = self.state_dir / "containerd"
        d.mkdir(exist_ok=True)
        cni = self.state_dir / "cni"
        # Version 2 syntax (containerd 2.x migrates it); restrict_oom_score_adj: without
        # CAP_SYS_RESOURCE here, runc may not lower a container's oom_score_adj below its own.
        config = f"""version = 2
root = "{d}/root"
state = "{d}/state"
[grpc]
  address = "{self.sock}"
[ttrpc]
  address = "{self.sock}.ttrpc"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
        BinaryName = "{RUNC}"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{CNI_BIN}"
    conf_dir = "{cni / "conf"}"
"""
        (d / "config.toml").write_text(config)
        path = f"{self.ctrd_bin}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self._spawn(
            "containerd",
            self.ctrd_bin / "containerd",
            ["--config", str(d / "config.toml")],
            env={"PATH": path},
        )
        deadline = time.monotonic() + 30
        while not self.ctr("version", check=False).returncode == 0:
            self._check_alive()
            if time.monotonic() > deadline:
                raise NodeError(f"containerd not answering:\n{self.log_tail('containerd')}")
            time.sleep(0.2)

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 300
    ) -> subprocess.CompletedProcess[str]:
        cmd = [str(self.ctrd_bin / "ctr"), "--address", str(self.sock), "-n", "k8s.io", *args]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise NodeError(f"ctr {' '.join(args)} exited {proc.returncode}: {proc.stderr.strip()}")
        return proc

    def _import_images(self, archive: Path) -> None:
        self.ctr("images", "import", "--snapshotter", "overlayfs", str(archive))
        self.ctr("images", "label", PAUSE_IMAGE, "io.cri-containerd.pinned=pinned", check=False)

    def _controllers(self) -> None:
        pki = self.cp.state_dir / "pki"
        kc = str(self.kubeconfig)
        self._spawn(
            "kube-controller-manager",
            self.bin / "kube-controller-manager",
            [
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                f"--service-account-private-key-file={pki / 'sa.key'}",
                f"--root-ca-file={pki / 'ca.crt'}",
                "--use-service-account-credentials=false",
                "--leader-elect=false",
                "--controllers=*",
                "--allocate-node-cidrs=false",
                "--configure-cloud-routes=false",
                "--cluster-name=refit",
                "--concurrent-gc-syncs=5",
                "--profiling=false",
                "--v=1",
            ],
        )
        self._spawn(
            "kube-scheduler",
            self.bin / "kube-scheduler",
            [
                f"--kubeconfig={kc}",
                f"--authentication-kubeconfig={kc}",
                f"--authorization-kubeconfig={kc}",
                "--bind-address=127.0.0.1",
                f"--secure-port={free_port()}",
                "--leader-elect=false",
                "--profiling=false",
                "--v=1",
            ],
        )

    def _kubelet(self) -> None:
        d = self.state_dir / "kubelet"
        d.mkdir()
        config = {
            "apiVersion": "kubelet.config.k8s.io/v1beta1",
            "kind": "KubeletConfiguration",
            # These machines run cgroup v1; kubelet >= 1.35 refuses it unless told otherwise.
            "failCgroupV1": False,
            "cgroupDriver": "cgroupfs",
            "containerRuntimeEndpoint": f"unix://{self.sock}",
            "address": host_ip(),
            "port": free_port(),
            "readOnlyPort": 0,
            "healthzBindAddress": "127.0.0.1",
            "healthzPort": free_port(),
            "authentication": {
                "anonymous": {"enabled": False},
                "webhook": {"enabled": True},
                "x509": {"clientCAFile": str(self.cp.state_dir / "pki" / "ca.crt")},
            },
            "authorization": {"mode": "AlwaysAllow"},
            "failSwapOn": False,
            "resolvConf": "/etc/resolv.conf",
            "podLogsDir": str(self.state_dir / "pod-logs"),
            # A test node: no evictions for a full disk or a busy memory, no image GC.
            "evictionHard": {
                "memory.available": "100Mi",
                "nodefs.available": "1%",
                "imagefs.available": "1%",
                "nodefs.inodesFree": "1%",
            },
            "imageGCHighThresholdPercent": 100,
            "imageGCLowThresholdPercent": 99,
            "serializeImagePulls": False,
            "maxPods": 30,
            "protectKernelDefaults": False,
            "syncFrequency": "10s",
            "nodeStatusUpdateFrequency": "5s",
        }
        (d / "config.yaml").write_text(yaml.safe_dump(config))
        path = f"{self.ctrd_bin}:{os.environ.get('PATH', '/usr/sbin:/usr/bin:/sbin:/bin')}"
        self._spawn(
            "kubelet",
            self.bin / "kubelet",
            [
                f"--config={d / 'config.yaml'}",
                f"--kubeconfig={self.kubeconfig}",
                f"--hostname-override={NODE_NAME}",
                f"--node-ip={host_ip()}",
                f"--root-dir={d / 'root'}",
                f"--cert-dir={d / 'pki'}",
                "--v=1",
            ],
            env={"PATH": path},
        )

    def _wait_node_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            self._check_alive()
            proc = self.cp.kubectl("get", "node", NODE_NAME, "-o", "json", check=False)
            if proc.returncode == 0:
                node = json.loads(proc.stdout)
                for c in node.get("status", {}).get("conditions", []):
                    if c["type"] == "Ready" and c["status"] == "True":
                        return
            if time.monotonic() > deadline:
                raise NodeError(
                    f"node {NODE_NAME} not Ready after {timeout:.0f}s: "
                    f"{proc.stdout[-1500:] or proc.stderr}\nkubelet:\n{self.log_tail('kubelet')}"
                )
            time.sleep(0.5)

    def _write_state(self) -> None:
        state = {
            "pids": self.pids,
            "controlplane": str(self.cp.state_dir),
            "containerd_bin": str(self.ctrd_bin),
            "timings": self.timings,
            "sysctl": self._sysctl_saved,
        }
        (self.state_dir / "node.json").write_text(json.dumps(state, indent=1))

    # --- teardown ----------------------------------------------------------------------------

    def stop(self) -> None:
        """Idempotent: delete every pod through the kubelet (which stops the sandboxes, so CNI
        releases their addresses), then SIGKILL what is left, stop the processes, unmount and
        remove what the node put on the machine."""
        # Controllers first, or the ReplicaSets replace the pods the drain deletes.
        for name in ("kube-controller-manager", "kube-scheduler"):
            if name in self._procs:
                kill_group(self._procs[name].pid, grace=0)
        if "kubelet" in self._procs and self._procs["kubelet"].poll() is None:
            with contextlib.suppress(Exception):
                self.drain_pods(timeout=60)
        if "kubelet" in self._procs:
            kill_group(self._procs["kubelet"].pid, grace=0)
        if "containerd" in self._procs and self._procs["containerd"].poll() is None:
            with contextlib.suppress(Exception):
                self._kill_tasks()
        if "containerd" in self._procs:
            kill_group(self._procs["containerd"].pid, grace=5)
        self._procs.clear()
        self.pids.clear()
        cleanup_machine(self.state_dir, self._sysctl_saved)
        self.cp.stop()
        if self._lock is not None:
            self._lock.close()
            self._lock = None

    def drain_pods(self, timeout: float = 60) -> None:
        """Delete every pod (all namespaces, no grace) and wait for containerd to run none."""
        self.cp.kubectl(
            "delete",
            "pods",
            "--all",
            "-A",
            "--grace-period=0",
            "--force",
            "--wait=false",
            check=False,
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.ctr("tasks", "ls", "-q", check=False).stdout.split():
                return
            time.sleep(1)

    def _kill_tasks(self) -> None:
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "kill", "-s", "SIGKILL", task, check=False)
        time.sleep(0.5)
        for task in self.ctr("tasks", "ls", "-q", check=False).stdout.split():
            self.ctr("tasks", "delete", "-f", task, check=False)


def _remove_nat_rules() -> None:
    for chain in ("PREROUTING", "OUTPUT"):
        while (
            _sh("iptables", "-w", "-t", "nat", "-D", chain, "-j", NAT_CHAIN, check=False).returncode
            == 0
        ):
            pass
    _sh("iptables", "-w", "-t", "nat", "-F", NAT_CHAIN, check=False)
    _sh("iptables", "-w", "-t", "nat", "-X", NAT_CHAIN, check=False)


def _remove_cni_nat() -> None:
    """The bridge plugin's masquerade rules of sandboxes that were never torn down (CNI DEL
    runs when the kubelet stops a sandbox; a node killed first leaves them)."""
    rules = _sh("iptables", "-w", "-t", "nat", "-S", "POSTROUTING", check=False).stdout
    chains = set()
    for line in rules.splitlines():
        if 'name: \\"refit\\"' not in line:
            continue
        args = shlex.split(line)
        if args[:1] == ["-A"] and "-j" in args:
            chains.add(args[args.index("-j") + 1])
            _sh("iptables", "-w", "-t", "nat", "-D", *args[1:], check=False)
    for chain in chains:
        if chain.startswith("CNI-"):
            _sh("iptables", "-w", "-t", "nat", "-F", chain, check=False)
            _sh("iptables", "-w", "-t", "nat", "-X", chain, check=False)


def _shims_of(state_dir: Path) -> list[int]:
    """containerd-shim processes started by this node's containerd (their command line names
    its socket or state folder)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            cmd
            and cmd[0].endswith(b"containerd-shim-runc-v2")
            and any(str(state_dir).encode() in part for part in cmd)
        ):
            pids.append(int(proc.name))
    return pids


def cleanup_machine(state_dir: Path, sysctl_saved: dict[str, str] | None = None) -> None:
    """What a node leaves on the machine when its processes are gone: leftover shims,
    mounts under its state folder, the NAT rules, the bridge, the sysctls it set."""
    for pid in _shims_of(state_dir):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, 9)
    mounts = []
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/mountinfo").read_text().splitlines():
            point = line.split()[4].replace("\\040", " ")
            if point.startswith(str(state_dir) + "/"):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        _sh("umount", "-l", point, check=False)
    _remove_nat_rules()
    _remove_cni_nat()
    _sh("ip", "link", "del", BRIDGE, check=False)
    for key, value in (sysctl_saved or {}).items():
        with contextlib.suppress(OSError):
            (Path("/proc/sys") / key).write_text(value)
    for pid in _shims_of(state_dir):
        deadline = time.monotonic() + 5
        while process_running(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
    _remove_kubepods_cgroups()


def _remove_kubepods_cgroups() -> None:
    """The kubelet's QoS cgroups (cgroupfs driver, v1: one tree per controller), once empty."""
    for top in Path("/sys/fs/cgroup").glob("*/kubepods"):
        dirs = sorted((p for p in top.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts))
        for d in [*dirs, top]:
            with contextlib.suppress(OSError):
                d.rmdir()


# --- CLI -------------------------------------------------------------------------------------


def _node_dir(arg: str | None) -> Path:
    return Path(arg) if arg else cache_dir() / "node-cluster"


def stop_recorded(state_dir: Path) -> bool:
    """Stop a detached node from its node.json; True if anything was running."""
    state_file = state_dir / "node.json"
    if not state_file.exists():
        return False
    state = json.loads(state_file.read_text())
    ran = False
    ctrd = Path(state["containerd_bin"])
    sock = state_dir / "containerd" / "containerd.sock"
    pids: dict[str, int] = state["pids"]
    kubeconfig = Path(state["controlplane"]) / "kubeconfig"
    for name in ("kube-controller-manager", "kube-scheduler"):
        pid = pids.get(name, 0)
        if pid and runs(pid, name):
            kill_group(pid, grace=0)
            ran = True
    ctr = [str(ctrd / "ctr"), "--address", str(sock), "-n", "k8s.io"]
    if process_running(pids.get("kubelet", 0)):
        bins = binaries(node=True)
        subprocess.run([str(bins / "kubectl"), f"--kubeconfig={kubeconfig}", "delete", "pods",
                        "--all", "-A", "--grace-period=0", "--force", "--wait=false"],
                       capture_output=True, timeout=60)  # fmt: skip
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = subprocess.run([*ctr, "tasks", "ls", "-q"], capture_output=True, text=True)
            if not out.stdout.split():
                break
            time.sleep(1)
    for name in ("kubelet", "containerd"):
        pid = pids.get(name, 0)
        if pid and runs(pid, name):
            if name == "containerd":
                tasks = subprocess.run([*ctr, "tasks", "ls", "-q"], capture_output=True, text=True)
                for task in tasks.stdout.split():
                    subprocess.run(
                        [*ctr, "tasks", "kill", "-s", "SIGKILL", task], capture_output=True
                    )
            kill_group(pid, grace=5 if name == "containerd" else 0)
            ran = True
    cleanup_machine(state_dir, state.get("sysctl"))
    from testbed.controlplane import stop_recorded as stop_cp

    ran = stop_cp(Path(state["controlplane"])) or ran
    state_file.unlink()
    return ran


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.node")
    parser.add_argument("action", choices=["up", "down"])
    parser.add_argument("--state-dir", help="default: ~/.cache/refit/node-cluster")
    args = parser.parse_args(argv)
    state_dir = _node_dir(args.state_dir)
    if args.action == "down":
        print("stopped" if stop_recorded(state_dir) else "no node was running")
        return 0
    stop_recorded(state_dir)
    node = Node(state_dir, detached=True)
    try:
        node.start()
    except ControlPlaneError as e:
        print(f"node: {e}", file=sys.stderr)
        return 1
    # The lock is for the life of the node, not of this CLI process: a detached node is
    # guarded by its node.json instead.
    print(
        f"node {NODE_NAME} Ready; timings (s): "
        + ", ".join(f"{k} {v:.1f}" for k, v in node.timings.items()),
        file=sys.stderr,
    )
    print(f"export KUBECONFIG={node.kubeconfig}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
