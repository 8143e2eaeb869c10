"""Container images for the real node (testbed/node.py), built here from packages the
registries serve -- no image registry, no Docker:

    debian rootfs   mmdebstrap of Debian bookworm (Debian packages): python3, python3-venv and
                    the shared libraries the test venv's vLLM/torch load
    base image      that rootfs with a venv at /usr/local (so Debian's python3 has the layout
                    python:3.11-slim has: pip installs under /usr/local)
    operator image  operator/Dockerfile, interpreted by the small builder below with
                    --build-arg BASE=<base image> (RUN steps in a chroot; pip from PyPI)
    worker image    the same rootfs as the runtime of a vLLM CPU pod whose Python and venv
                    (the test venv) are mounted read-only from the host (see docs/node.md)
    busybox, pause  busybox-static's binary (a Debian package)

Everything is written as one OCI archive under ~/.cache/refit/node/images/, keyed by the
inputs, and imported into containerd by testbed/node.py. Building needs root (mmdebstrap,
chroot) and the network (Debian mirror, PyPI): it is set-up (hack/node/setup.sh), never run
by the tests, which only check that the archive for the current sources exists.

    python -m testbed.node_images build     # build what is missing, print the archive path
    python -m testbed.node_images path      # print the archive path (exit 1 if not built)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from testbed.controlplane import cache_dir

REPO = Path(__file__).resolve().parents[1]
SUITE = "bookworm"
# The base image's Python and the libraries the mounted venv (pyenv CPython 3.11, torch,
# vLLM CPU) dlopens; `ldd` over the venv's extension modules gave this list.
ROOTFS_PACKAGES = [
    "python3",
    "python3-venv",
    "ca-certificates",
    "procps",
    "libnuma1",
    "libstdc++6",
    "libgomp1",
    "libssl3",
    "libffi8",
    "zlib1g",
    "libbz2-1.0",
    "liblzma5",
    "libsqlite3-0",
    "libreadline8",
    "libncursesw6",
    "libuuid1",
    "libexpat1",
    "libgdbm6",
]
# vLLM CPU's torch compiles a few kernels at run time (torch._inductor wants g++), even with
# --enforce-eager: without it the engine dies at the first completion with InvalidCxxCompiler.
WORKER_EXTRA_PACKAGES = ["g++"]
BASE_IMAGE = "localhost/refit/debian-python:bookworm"
OPERATOR_IMAGE = "localhost/refit/refit-operator:dev"
WORKER_IMAGE = "localhost/refit/vllm-cpu-runtime:dev"
BUSYBOX_IMAGE = "localhost/refit/busybox:dev"
PAUSE_IMAGE = "localhost/refit/pause:dev"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
BUSYBOX_APPLETS = ["sh", "sleep", "httpd", "wget", "cat", "echo", "ls", "kill", "ps", "id"]
# What operator/Dockerfile COPYs: the operator image's cache key.
OPERATOR_INPUTS = [
    "operator/Dockerfile",
    "pyproject.toml",
    "README.md",
    "operator",
    "worker_image/refit_worker",
    "sdk/refit_client",
]


class ImageBuildError(RuntimeError):
    pass


def node_cache() -> Path:
    return cache_dir() / "node"


def log(msg: str) -> None:
    print(f"node-images: {msg}", file=sys.stderr, flush=True)


def _hash_paths(paths: list[Path], extra: str = "") -> str:
    h = hashlib.sha256(extra.encode())
    for top in paths:
        files = sorted(p for p in top.rglob("*") if p.is_file()) if top.is_dir() else [top]
        for f in files:
            if "__pycache__" in f.parts or f.suffix == ".pyc":
                continue
            h.update(str(f.relative_to(REPO)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def archive_key() -> str:
    packages = [SUITE, *ROOTFS_PACKAGES, *WORKER_EXTRA_PACKAGES]
    rootfs = hashlib.sha256(" ".join(packages).encode()).hexdigest()[:8]
    builder = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:6]
    return f"{rootfs}-{builder}-{_hash_paths([REPO / p for p in OPERATOR_INPUTS])}"


def archive_path() -> Path:
    return node_cache() / "images" / f"refit-node-images-{archive_key()}.tar"


# --- running things in a root filesystem -----------------------------------------------------


def run_in(rootfs: Path, cmd: str, *, env: dict[str, str], workdir: str = "/") -> None:
    """`cmd` by /bin/sh in a chroot of rootfs, in private mount and pid namespaces with /proc,
    /dev and /sys mounted, sharing the host's network (pip needs PyPI)."""
    resolv = rootfs / "etc" / "resolv.conf"
    if resolv.is_symlink() or not resolv.exists():
        resolv.unlink(missing_ok=True)
        shutil.copy("/etc/resolv.conf", resolv)
    (rootfs / workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
    r = shlex.quote(str(rootfs))
    inner = shlex.quote(f"cd {shlex.quote(workdir)} && {cmd}")
    # The build host's CA bundle for the build only (a TLS-intercepting proxy's CA, say): the
    # image keeps Debian's own.
    ca = Path("/etc/ssl/certs/ca-certificates.crt")
    ca_in = rootfs / str(ca).lstrip("/")
    trust = (
        f"mount --bind {ca} {shlex.quote(str(ca_in))} && " if ca.exists() and ca_in.exists() else ""
    )
    script = (
        f"mount --rbind /dev {r}/dev && mount -t proc proc {r}/proc && "
        f"mount --rbind /sys {r}/sys && {trust}exec chroot {r} /bin/sh -c {inner}"
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--pid", "--fork", "--propagation", "private", "sh", "-c", script],
        env={"PATH": DEFAULT_PATH, "HOME": "/root", "LANG": "C.UTF-8", **env},
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise ImageBuildError(f"RUN {cmd!r} exited {proc.returncode}:\n{tail}")


def copy_tree(src: Path, dest: Path) -> None:
    """cp -a semantics: a directory's contents merge into dest; a file lands at dest."""
    if src.is_dir() and not src.is_symlink():
        dest.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", "--reflink=auto", f"{src}/.", str(dest)], check=True)
    else:
        dest.parent.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-a", "--reflink=auto", str(src), str(dest)], check=True)


# --- the Debian root filesystem and the base image ------------------------------------------


def debian_rootfs(packages: list[str]) -> Path:
    """mmdebstrap bookworm (minbase + packages), cached as a directory."""
    key = hashlib.sha256(" ".join([SUITE, *packages]).encode()).hexdigest()[:8]
    final = node_cache() / "rootfs" / f"{SUITE}-{key}"
    if (final / ".complete").exists():
        return final
    tmp = final.with_name(final.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    log(f"mmdebstrap {SUITE} into {final} (about a minute)")
    started = time.monotonic()
    proc = subprocess.run(
        [
            "mmdebstrap",
            "--variant=minbase",
            "--mode=root",
            "--format=directory",
            f"--include={','.join(packages)}",
            SUITE,
            str(tmp),
        ],
        capture_output=True,
        text=True,
    )
    if proc.returncode != 0:
        raise ImageBuildError(f"mmdebstrap failed:\n{proc.stderr[-3000:]}")
    # The base image: Debian's python3 as a venv rooted at /usr/local, the layout of the
    # python:3.11-slim image operator/Dockerfile is written for (pip --prefix, /usr/local/bin).
    run_in(tmp, "python3 -m venv /usr/local", env={})
    for junk in ("var/cache/apt/archives", "var/lib/apt/lists", "root/.cache"):
        for p in (tmp / junk).glob("*"):
            if p.is_file():
                p.unlink()
            elif p.is_dir() and p.name != "partial":
                shutil.rmtree(p)
    (tmp / ".complete").write_text("ok\n")
    os.rename(tmp, final)
    log(f"rootfs ready in {time.monotonic() - started:.0f} s")
    return final


def busybox_rootfs() -> Path:
    """busybox-static's binary (apt-get download, dpkg -x) with a few applet links."""
    final = node_cache() / "rootfs" / "busybox"
    if (final / ".complete").exists():
        return final
    tmp = Path(tempfile.mkdtemp(prefix="busybox-", dir=final.parent.parent))
    try:
        get = ["apt-get", "download", "-q", "busybox-static"]
        if subprocess.run(get, cwd=tmp, capture_output=True).returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], check=True, capture_output=True)
            subprocess.run(get, cwd=tmp, check=True, capture_output=True)
        deb = next(tmp.glob("busybox-static_*.deb"))
        subprocess.run(["dpkg-deb", "-x", str(deb), str(tmp / "x")], check=True)
        root = tmp / "root"
        (root / "bin").mkdir(parents=True)
        shutil.copy2(tmp / "x" / "bin" / "busybox", root / "bin" / "busybox")
        for applet in BUSYBOX_APPLETS:
            (root / "bin" / applet).symlink_to("busybox")
        for d in ("tmp", "proc", "sys", "dev", "etc"):
            (root / d).mkdir()
        (root / "tmp").chmod(0o1777)
        (root / ".complete").write_text("ok\n")
        shutil.rmtree(final, ignore_errors=True)
        os.rename(root, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


# --- a small Dockerfile interpreter ----------------------------------------------------------


@dataclass
class Stage:
    name: str | None
    rootfs: Path
    env: dict[str, str] = field(default_factory=dict)
    args: dict[str, str] = field(default_factory=dict)
    workdir: str = "/"
    user: str = ""
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None


def _instructions(text: str) -> Iterator[tuple[str, str]]:
    joined = re.sub(r"\\\n", " ", text)
    for raw in joined.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        yield word.upper(), rest.strip()


def _subst(s: str, scope: dict[str, str]) -> str:
    def one(m: re.Match[str]) -> str:
        name = m.group(1) or m.group(2)
        return scope.get(name, "")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, s)


def _kv(rest: str) -> dict[str, str]:
    parts = shlex.split(rest)
    if len(parts) >= 2 and "=" not in parts[0]:  # legacy `ENV KEY value`
        return {parts[0]: " ".join(parts[1:])}
    return dict(p.split("=", 1) for p in parts)


def build_dockerfile(
    dockerfile: Path,
    context: Path,
    *,
    build_args: dict[str, str],
    bases: dict[str, tuple[Path, dict[str, Any]]],
    workdir: Path,
) -> Stage:
    """Interpret a Dockerfile (ARG, FROM [AS], WORKDIR, COPY [--from], RUN, ENV, USER,
    ENTRYPOINT, CMD -- what operator/Dockerfile uses) into a root filesystem. FROM must name
    a key of `bases` (a local root filesystem and its image config) or an earlier stage."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    stage: Stage | None = None
    for word, rest in _instructions(dockerfile.read_text()):
        scope = {**global_args, **(stage.args if stage else {}), **(stage.env if stage else {})}
        if word == "ARG":
            name, _, default = rest.partition("=")
            value = build_args.get(name, _subst(default, scope))
            if stage is None:
                global_args[name] = value
            else:
                stage.args[name] = build_args.get(name, global_args.get(name, value))
            continue
        if word == "FROM":
            ref, *alias = _subst(rest, global_args).split()
            alias_name = alias[1] if len(alias) == 2 and alias[0].upper() == "AS" else None
            root = workdir / f"stage{len(stages)}"
            shutil.rmtree(root, ignore_errors=True)
            prior = {s.name: s for s in stages if s.name}
            if ref in prior:
                copy_tree(prior[ref].rootfs, root)
                env = dict(prior[ref].env)
            elif ref in bases:
                copy_tree(bases[ref][0], root)
                env = dict(_env_dict(bases[ref][1]))
            else:
                raise ImageBuildError(
                    f"FROM {ref}: not a local base image (have {sorted(bases)}); "
                    "pass --build-arg BASE=<one of them>"
                )
            stage = Stage(alias_name, root, env=env)
            stages.append(stage)
            continue
        if stage is None:
            raise ImageBuildError(f"{word} before FROM")
        if word == "WORKDIR":
            stage.workdir = os.path.join(stage.workdir, _subst(rest, scope))
            (stage.rootfs / stage.workdir.lstrip("/")).mkdir(parents=True, exist_ok=True)
        elif word == "ENV":
            stage.env.update({k: _subst(v, scope) for k, v in _kv(rest).items()})
        elif word == "USER":
            stage.user = _subst(rest, scope)
        elif word in ("ENTRYPOINT", "CMD"):
            argv = json.loads(rest) if rest.startswith("[") else ["/bin/sh", "-c", rest]
            setattr(stage, word.lower(), argv)
        elif word == "COPY":
            parts = shlex.split(_subst(rest, scope))
            src_root = context
            if parts[0].startswith("--from="):
                src_name = parts.pop(0).split("=", 1)[1]
                src_root = next(s.rootfs for s in stages if s.name == src_name)
            *srcs, dest = parts
            dest_path = os.path.join(stage.workdir, dest)
            for src in srcs:
                s = src_root / src.lstrip("/")
                target = stage.rootfs / dest_path.lstrip("/")
                if s.is_file() and (dest.endswith("/") or len(srcs) > 1):
                    target = target / s.name
                copy_tree(s, target)
        elif word == "RUN":
            run_in(stage.rootfs, rest, env={**scope, **stage.env}, workdir=stage.workdir)
        else:
            raise ImageBuildError(f"unsupported Dockerfile instruction {word}")
    if stage is None:
        raise ImageBuildError(f"{dockerfile}: no FROM")
    return stage


def _env_dict(config: dict[str, Any]) -> dict[str, str]:
    return dict(e.split("=", 1) for e in config.get("Env", []))


# --- OCI archives ----------------------------------------------------------------------------


class _Blobs:
    def __init__(self, layout: Path) -> None:
        self.dir = layout / "blobs" / "sha256"
        self.dir.mkdir(parents=True, exist_ok=True)

    def add_bytes(self, data: bytes) -> tuple[str, int]:
        digest = hashlib.sha256(data).hexdigest()
        (self.dir / digest).write_bytes(data)
        return f"sha256:{digest}", len(data)

    def add_layer(self, rootfs: Path, cache: dict[Path, tuple[str, int]]) -> tuple[str, int]:
        """An uncompressed tar of rootfs (layers are local: gzip would only cost CPU)."""
        if rootfs in cache:
            return cache[rootfs]
        tmp = self.dir / ".layer.partial"
        with tmp.open("wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as t:
            for name in sorted(os.listdir(rootfs)):
                if name in (".complete",):
                    continue
                t.add(rootfs / name, arcname=name)
        h = hashlib.sha256()
        with tmp.open("rb") as r:
            while chunk := r.read(1 << 20):
                h.update(chunk)
        size = tmp.stat().st_size
        tmp.rename(self.dir / h.hexdigest())
        cache[rootfs] = (f"sha256:{h.hexdigest()}", size)
        return cache[rootfs]


def write_oci_archive(out: Path, images: list[tuple[str, Path, dict[str, Any]]]) -> None:
    """One OCI image-layout tar holding each (ref, rootfs, config) as a one-layer image."""
    with tempfile.TemporaryDirectory(prefix="oci-", dir=out.parent) as tmpdir:
        layout = Path(tmpdir)
        blobs = _Blobs(layout)
        layers: dict[Path, tuple[str, int]] = {}
        manifests = []
        for ref, rootfs, config in images:
            ldigest, lsize = blobs.add_layer(rootfs, layers)
            cfg = {
                "architecture": "amd64",
                "os": "linux",
                "config": config,
                "rootfs": {"type": "layers", "diff_ids": [ldigest]},
            }
            cdigest, csize = blobs.add_bytes(json.dumps(cfg).encode())
            manifest = {
                "schemaVersion": 2,
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "config": {
                    "mediaType": "application/vnd.oci.image.config.v1+json",
                    "digest": cdigest,
                    "size": csize,
                },
                "layers": [
                    {
                        "mediaType": "application/vnd.oci.image.layer.v1.tar",
                        "digest": ldigest,
                        "size": lsize,
                    }
                ],
            }
            mdigest, msize = blobs.add_bytes(json.dumps(manifest).encode())
            manifests.append(
                {
                    "mediaType": "application/vnd.oci.image.manifest.v1+json",
                    "digest": mdigest,
                    "size": msize,
                    "platform": {"architecture": "amd64", "os": "linux"},
                    "annotations": {
                        "org.opencontainers.image.ref.name": ref,
                        "io.containerd.image.name": ref,
                    },
                }
            )
        (layout / "index.json").write_text(json.dumps({"schemaVersion": 2, "manifests": manifests}))
        (layout / "oci-layout").write_text('{"imageLayoutVersion":"1.0.0"}')
        partial = out.with_suffix(".partial")
        with tarfile.open(partial, "w") as t:
            for name in ("oci-layout", "index.json", "blobs"):
                t.add(layout / name, arcname=name)
        partial.rename(out)


def _config(stage: Stage) -> dict[str, Any]:
    env = {"PATH": DEFAULT_PATH, **stage.env}
    cfg: dict[str, Any] = {"Env": [f"{k}={v}" for k, v in env.items()], "WorkingDir": stage.workdir}
    if stage.user:
        cfg["User"] = stage.user
    if stage.entrypoint is not None:
        cfg["Entrypoint"] = stage.entrypoint
    if stage.cmd is not None:
        cfg["Cmd"] = stage.cmd
    return cfg


def build(force: bool = False) -> Path:
    """Build the archive if the current sources have none; return its path."""
    out = archive_path()
    if out.exists() and not force:
        return out
    if os.geteuid() != 0:
        raise ImageBuildError("building the node images needs root (mmdebstrap, chroot)")
    started = time.monotonic()
    out.parent.mkdir(parents=True, exist_ok=True)
    rootfs = debian_rootfs(ROOTFS_PACKAGES)
    worker_rootfs = debian_rootfs(ROOTFS_PACKAGES + WORKER_EXTRA_PACKAGES)
    bbx = busybox_rootfs()
    base_cfg = {"Env": [f"PATH={DEFAULT_PATH}"], "Cmd": ["/bin/bash"]}
    with tempfile.TemporaryDirectory(prefix="build-", dir=out.parent) as tmp:
        log(
            f"building {OPERATOR_IMAGE} from operator/Dockerfile (BASE={BASE_IMAGE}; pip from PyPI)"
        )
        op = build_dockerfile(
            REPO / "operator" / "Dockerfile",
            REPO,
            build_args={"BASE": BASE_IMAGE},
            bases={BASE_IMAGE: (rootfs, base_cfg)},
            workdir=Path(tmp),
        )
        log("writing the OCI archive")
        write_oci_archive(
            out,
            [
                (BASE_IMAGE, rootfs, base_cfg),
                (WORKER_IMAGE, worker_rootfs, {"Env": [f"PATH={DEFAULT_PATH}"]}),
                (OPERATOR_IMAGE, op.rootfs, _config(op)),
                (BUSYBOX_IMAGE, bbx, {"Env": ["PATH=/bin"], "Cmd": ["sh"]}),
                (
                    PAUSE_IMAGE,
                    bbx,
                    {"Env": ["PATH=/bin"], "Entrypoint": ["/bin/sleep"], "Cmd": ["2147483647"]},
                ),
            ],
        )
    for old in out.parent.glob("refit-node-images-*.tar"):
        if old != out:
            old.unlink()
    log(f"images built in {time.monotonic() - started:.0f} s: {out}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m testbed.node_images")
    parser.add_argument("action", choices=["build", "path"])
    parser.add_argument("--force", action="store_true")
    args = parser.parse_args(argv)
    if args.action == "path":
        if not archive_path().exists():
            print(f"not built: {archive_path()} (run hack/node/setup.sh)", file=sys.stderr)
            return 1
        print(archive_path())
        return 0
    try:
        print(build(force=args.force))
    except ImageBuildError as e:
        print(f"node-images: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
