"""The wire contract between the Refit operator and the refit_worker vLLM plugin.

Both packages import this module, so it depends on the standard library alone. It names
the RPC methods the operator calls through vLLM's ``/collective_rpc``, the fencing header
its calls carry, the capability names the plugin reports, and the two public file formats a
trainer writes next to a checkpoint: ``refit-manifest.json`` and ``refit-probe.json``.
Changing anything here is a change of a public format: bump the matching
``*_FORMAT_VERSION``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, NamedTuple

# --- Kubernetes-facing names shared by the operator, the chart and the example fleet ---
API_GROUP = "refit.rollout.dev"
READINESS_GATE = f"{API_GROUP}/weights-ready"
# The worker's readiness probe (refit_worker.readiness): 503 until a refit pass vouched for the
# weights of this process, so a restarted container is never Ready on unprobed weights.
READY_PATH = "/refit/ready"

# How long a client of the pods keeps an idle connection for reuse. vLLM's API server closes
# one idle for VLLM_HTTP_TIMEOUT_KEEP_ALIVE (5 s by default); a request sent on a pooled
# connection at the moment the server closes it meets a reset before any answer, which no
# client retries for a POST (a load-test request was lost so; a refit step would fail
# PodUnreachable).
# Expiring idle connections well before the server does closes that race.
CLIENT_KEEPALIVE_SECONDS = 2.0


# --- Which requests need which credential (refit_worker.guard enforces it in the pod; the
# operator's client sends a credential only where it is needed) ---
# vLLM's own --api-key middleware guards exactly these prefixes (vllm/entrypoints/serve/
# middleware/authenticate.py); the guard leaves them to it.
API_KEY_PREFIXES = ("/v1", "/v2", "/inference", "/cohere")
# Read-only probes that must work without credentials (kubelet, Prometheus, load balancers).
OPEN_PATHS = frozenset(
    {"/health", "/metrics", "/ping", "/version", "/load", "/ready", "/readyz", READY_PATH}
)
OPEN_METHODS = frozenset({"GET", "HEAD"})
# vLLM's runtime LoRA routes (with VLLM_ALLOW_RUNTIME_LORA_UPDATING=1) sit under /v1 but change
# what the engine serves: under vLLM's rule alone anyone holding the API key, or anyone at all
# without one, loads or unloads adapters. They are admin paths, fenced like the others; the
# guard hands the request on to vLLM with the API key in place of the admin token.
ADAPTER_PATHS = frozenset({"/v1/load_lora_adapter", "/v1/unload_lora_adapter"})


def needs_admin(method: str, path: str) -> bool:
    """Whether a request must carry the admin token (pure; the whole routing policy)."""
    if path.rstrip("/") in ADAPTER_PATHS:
        return True
    if path.startswith(API_KEY_PREFIXES):
        return False
    if path in OPEN_PATHS or path.rstrip("/") in OPEN_PATHS:
        return method.upper() not in OPEN_METHODS
    return True


def bad_request_body(message: str, param: str) -> dict[str, Any]:
    """The JSON body of a 400 the worker plugin answers itself (a malformed fencing header, a
    malformed vouch), shaped like vLLM's own error answers."""
    return {"error": {"message": message, "type": "BadRequestError", "param": param, "code": 400}}


# --- RPC methods of refit_worker.extension.RefitWorkerExtension (via /collective_rpc) ---
RPC_INFO = "refit_info"
RPC_PREFLIGHT = "refit_preflight"
# Preflight, then hold the verified bytes in the worker's memory (within its staging budget)
# for refit_load; runs while the pod still serves.
RPC_STAGE = "refit_stage"
RPC_LOAD = "refit_load"
RPC_PROBE_REFERENCE = "refit_probe_reference"
# Broadcast refits (docs/broadcast.md): what the worker received over the network and loaded,
# checked against the promised transfer manifest's digest; refit_received(digest, version).
RPC_RECEIVED = "refit_received"
# LoRA adapters (spec.adapter): the path rules, the manifest and every file's digest, a PEFT
# LoRA adapter_config.json vLLM can load, and that the adapter fits the engine (its rank, the
# modules it targets and their sizes: refit_worker.lora_adapter); refit_adapter_check(path) ->
# {"rank", "targetModules", "baseModel", "path", "files", "bytes", "tensors", "seconds"}.
RPC_ADAPTER_CHECK = "refit_adapter_check"
ADAPTER_CONFIG_FILE = "adapter_config.json"
# vLLM's RL route: the pod's receiving workers (TP x PP x DP), the ranks a broadcast gives it.
WORLD_SIZE_PATH = "/get_world_size"
# The read-back (docs/concepts.md, "Read-back checksums"): SHA-256 of every module buffer that
# is not a parameter, keyed and hashed as vLLM's /weight_checker keys and hashes parameters
# (vllm/model_executor/model_loader/weight_checksum.py covers named_parameters() only), plus
# the model's dtype: {"dtype": str, "buffers": {key: hex digest}}.
RPC_BUFFER_DIGESTS = "refit_buffer_digests"
# vLLM's own weight checker (vllm/entrypoints/rl/online/api_router.py): POST {"action":
# "checksum"} answers {"checksums": {"dp0:pp0:pcp0:tp0:<param>": sha256 hex}}, one key per
# parameter of every worker, read after process_weights_after_loading.
WEIGHT_CHECKER_PATH = "/weight_checker"
# The vLLM weight transfer backend refit_worker.plugin registers (refit_worker.broadcast's
# gloo_engine and gloo_trainer): a server enables it with
# --weight-transfer-config '{"backend": "refit-gloo"}'.
TRANSFER_BACKEND = "refit-gloo"

# --- Fencing: one driver per pod (refit_worker.fence, refit_worker.guard) ---
# Every call a refit pass makes to a pod outside /v1 carries this header: a non-negative
# integer, monotonic across passes and operator leaders, opaque to the pod. The admin guard
# refuses a state-changing call whose token is lower than the highest the pod has seen.
FENCE_HEADER = "X-Refit-Fence"
# The refusal's code: HTTP 409, body {"error": {"code": "StaleFence", "message": "..."}}.
STALE_FENCE = "StaleFence"
# The 409 code of a POST /refit/ready bound to another process than the pod's (the container
# restarted between the probe and the vouch): refit_worker.readiness.
PROCESS_CHANGED = "ProcessChanged"

# --- Files a trainer writes into a checkpoint directory ---
MANIFEST_FILE = "refit-manifest.json"
PROBE_FILE = "refit-probe.json"
# A fleet whose engines run a speculative drafter with weights of its own (vLLM's
# `draft_model` method) needs the drafter's checkpoint beside the target's: a subdirectory of
# this name, a checkpoint of its own (safetensors and a refit-manifest.json). The worker
# verifies and loads both, or neither (DrafterMissing).
DRAFTER_DIR = "drafter"
# ... and in a broadcast (docs/broadcast.md), the drafter's tensors travel in the target's
# transfer under this prefix + the drafter's own tensor name, promised in the same transfer
# manifest; no target tensor may start with it. A transfer without any means what it always
# meant: the target's tensors only.
DRAFTER_PREFIX = "drafter."
MANIFEST_FORMAT_VERSION = 2  # what writers write
# The file digest each manifest format version carries; readers accept every version here.
# 2: BLAKE3, about 5x faster to verify than SHA-256 per core (bench/results: verification
# bounds how fast a pod reads a checkpoint); 1: SHA-256, still read.
MANIFEST_DIGESTS: dict[int, str] = {1: "sha256", 2: "blake3"}
PROBE_FORMAT_VERSION = 1
TRANSFER_MANIFEST_FORMAT_VERSION = 1  # the promise of a broadcast refit (TransferManifest)

# --- Capabilities refit_info reports (each is a reload-safety property of the image) ---
CAP_FLASHINFER_BMM_SCALES = "flashinfer-bmm-scales-per-forward"
CAP_ATTENTION_O_SCALE_RESET = "attention-o-scale-reset-on-load"
CAP_TRTLLM_DECODE_DEVICE_SCALES = "trtllm-decode-device-scales-under-capture"
CAP_MLA_DECODE_SCALES = "mla-decode-scales-per-forward"
CAP_FLASHINFER_SINKS_IN_PLACE = "flashinfer-sinks-in-place"
CAP_MLA_WEIGHTS_IN_PLACE = "mla-w-uv-w-uk-t-in-place"
# Unquantized MoE experts laid out for their kernel again by every reload (vLLM #42821 on
# CPU). Not required of every image: a pod whose MoE layers lack it reports an unsafe reason.
CAP_MOE_RELAYOUT_ON_RELOAD = "moe-relayout-on-reload"
CAP_VERIFIED_RELOAD = "verified-reload"
CAP_ADMIN_GUARD = "admin-guard"
# The guard answers an admin request whose handler raised (a refused /collective_rpc, a
# refused transfer route) itself, with vLLM's own error body, so uvicorn keeps the connection
# open: the operator pools RPC connections only to a pod that reports it.
CAP_ERRORS_KEEP_CONNECTION = "admin-errors-keep-connection"
# What an image must report before the operator refits it (unless the spec allows it).
REQUIRED_CAPABILITIES: tuple[str, ...] = (
    CAP_FLASHINFER_BMM_SCALES,
    CAP_ATTENTION_O_SCALE_RESET,
    CAP_TRTLLM_DECODE_DEVICE_SCALES,
    CAP_MLA_DECODE_SCALES,
    CAP_FLASHINFER_SINKS_IN_PLACE,
    CAP_MLA_WEIGHTS_IN_PLACE,
    CAP_VERIFIED_RELOAD,
)


class ContractError(ValueError):
    """A document does not follow this contract; the message names the field."""


def _require(doc: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in doc:
        raise ContractError(f"{where}: missing field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool):
        raise ContractError(f"{where}: field {key!r} has the wrong type ({type(value).__name__})")
    return value


def _check_version(doc: dict[str, Any], expected: int, where: str) -> None:
    version = _require(doc, "formatVersion", int, where)
    if version != expected:
        raise ContractError(f"{where}: formatVersion {version} is not supported (want {expected})")


# ---------------------------------------------------------------------------------------
# refit-manifest.json
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ManifestFile:
    name: str  # relative to the checkpoint directory, no '/' or '..'
    size: int
    digest: str  # hex digest of the whole file, by the manifest version's algorithm


@dataclass(frozen=True)
class ManifestTensor:
    file: str
    dtype: str  # safetensors dtype name: F32, BF16, F16, F8_E4M3, ...
    shape: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    files: tuple[ManifestFile, ...]
    tensors: dict[str, ManifestTensor]
    format: str = "safetensors"
    formatVersion: int = MANIFEST_FORMAT_VERSION

    @property
    def algorithm(self) -> str:
        """The digest algorithm of ``files[].digest``: ``sha256`` or ``blake3``."""
        return MANIFEST_DIGESTS[self.formatVersion]

    def to_json_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["files"] = [
            {"name": f.name, "size": f.size, self.algorithm: f.digest} for f in self.files
        ]
        doc["tensors"] = {
            name: {"file": t.file, "dtype": t.dtype, "shape": list(t.shape)}
            for name, t in sorted(self.tensors.items())
        }
        return doc

    @classmethod
    def from_json_dict(cls, doc: Any) -> Manifest:
        where = MANIFEST_FILE
        if not isinstance(doc, dict):
            raise ContractError(f"{where}: not a JSON object")
        version = _require(doc, "formatVersion", int, where)
        if version not in MANIFEST_DIGESTS:
            known = ", ".join(map(str, MANIFEST_DIGESTS))
            raise ContractError(f"{where}: formatVersion {version} is not supported ({known})")
        algorithm = MANIFEST_DIGESTS[version]
        fmt = _require(doc, "format", str, where)
        files = []
        for i, f in enumerate(_require(doc, "files", list, where)):
            w = f"{where}: files[{i}]"
            if not isinstance(f, dict):
                raise ContractError(f"{w}: not an object")
            name = _require(f, "name", str, w)
            if not name or "/" in name or name in (".", ".."):
                raise ContractError(f"{w}: name {name!r} must be a plain file name")
            digest = _require(f, algorithm, str, w)
            if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
                raise ContractError(f"{w}: {algorithm} must be 64 lowercase hex digits")
            files.append(ManifestFile(name, _require(f, "size", int, w), digest))
        tensors = {}
        for name, t in _require(doc, "tensors", dict, where).items():
            w = f"{where}: tensors[{name!r}]"
            if not isinstance(t, dict):
                raise ContractError(f"{w}: not an object")
            shape = _require(t, "shape", list, w)
            if not all(isinstance(d, int) and d >= 0 for d in shape):
                raise ContractError(f"{w}: shape must be a list of non-negative integers")
            tensors[name] = ManifestTensor(
                _require(t, "file", str, w), _require(t, "dtype", str, w), tuple(shape)
            )
        return cls(files=tuple(files), tensors=tensors, format=fmt, formatVersion=version)


# ---------------------------------------------------------------------------------------
# Transfer manifest: what a trainer promises to broadcast (docs/formats.md, docs/broadcast.md)
# ---------------------------------------------------------------------------------------
# Digests are BLAKE3-256, written as 64 lowercase hex digits (refit_worker.transfer_manifest
# computes them; any BLAKE3 implementation gives the same):
#   tensor digest   = BLAKE3(name 0x00 dtype 0x00 dims 0x00 data)
#       name: UTF-8; dtype: the safetensors dtype name (F32, BF16, ...); dims: the shape as
#       decimal integers joined by "," ("" for a scalar); data: the elements in row-major
#       order, little-endian, exactly numel x element size bytes.
#   manifest digest = BLAKE3(d_1 d_2 ... d_n), the tensors' 32-byte digests in the order of
#       their names sorted by UTF-8 bytes.
# Two levels, so that tensors can arrive (and be hashed) in any order, a mismatch names the
# tensor, and one digest still identifies the whole set of weights.
def _hex64(value: Any) -> bool:
    hexdigits = "0123456789abcdef"
    return isinstance(value, str) and len(value) == 64 and all(c in hexdigits for c in value)


@dataclass(frozen=True)
class TransferTensor:
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    digest: str  # the tensor digest (above)


@dataclass(frozen=True)
class TransferManifest:
    tensors: dict[str, TransferTensor]
    digest: str  # the manifest digest (above)
    formatVersion: int = TRANSFER_MANIFEST_FORMAT_VERSION

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "formatVersion": self.formatVersion,
            "blake3": self.digest,
            "tensors": {
                name: {"dtype": t.dtype, "shape": list(t.shape), "blake3": t.digest}
                for name, t in sorted(self.tensors.items())
            },
        }

    @classmethod
    def from_json_dict(cls, doc: Any) -> TransferManifest:
        """Parse and check the format; whether ``blake3`` is the digest of the tensors'
        digests needs BLAKE3 (refit_worker.transfer_manifest.parse_manifest checks it too)."""
        where = "transfer manifest"
        if not isinstance(doc, dict):
            raise ContractError(f"{where}: not a JSON object")
        _check_version(doc, TRANSFER_MANIFEST_FORMAT_VERSION, where)
        digest = _require(doc, "blake3", str, where)
        if not _hex64(digest):
            raise ContractError(f"{where}: blake3 must be 64 lowercase hex digits")
        raw = _require(doc, "tensors", dict, where)
        if not raw:
            raise ContractError(f"{where}: tensors is empty")
        tensors = {}
        for name, t in raw.items():
            w = f"{where}: tensors[{name!r}]"
            if not name or "\0" in name or not isinstance(t, dict):
                raise ContractError(f"{w}: needs a non-empty name without NUL and an object")
            dtype = _require(t, "dtype", str, w)
            shape = _require(t, "shape", list, w)
            if not dtype or "\0" in dtype:
                raise ContractError(f"{w}: dtype must be a safetensors dtype name")
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
                raise ContractError(f"{w}: shape must be a list of non-negative integers")
            if not _hex64(t.get("blake3")):
                raise ContractError(f"{w}: blake3 must be 64 lowercase hex digits")
            tensors[name] = TransferTensor(dtype, tuple(shape), t["blake3"])
        return cls(tensors=tensors, digest=digest)


# ---------------------------------------------------------------------------------------
# refit-probe.json: what the trainer's own model computes on fixed token ids
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ProbePrompt:
    token_ids: tuple[int, ...]
    # logprobs[i] is the reference log-probability of token_ids[i] given token_ids[:i];
    # logprobs[0] is None (nothing to condition on), as in vLLM's prompt_logprobs.
    logprobs: tuple[float | None, ...]

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood of the scored tokens (all but the first)."""
        scored = [lp for lp in self.logprobs[1:] if lp is not None]
        return -sum(scored) / len(scored) if scored else math.nan


@dataclass(frozen=True)
class ProbeReference:
    version: str  # the checkpoint version this reference was computed for
    dtype: str  # dtype the reference was computed in: float32, bfloat16, ...
    prompts: tuple[ProbePrompt, ...]
    formatVersion: int = PROBE_FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)  # e.g. the tool that wrote it

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "formatVersion": self.formatVersion,
            "version": self.version,
            "dtype": self.dtype,
            "prompts": [
                {"tokenIds": list(p.token_ids), "logprobs": list(p.logprobs), "nll": p.nll}
                for p in self.prompts
            ],
            "extra": self.extra,
        }

    @classmethod
    def from_json_dict(cls, doc: Any) -> ProbeReference:
        where = PROBE_FILE
        if not isinstance(doc, dict):
            raise ContractError(f"{where}: not a JSON object")
        _check_version(doc, PROBE_FORMAT_VERSION, where)
        prompts = []
        raw_prompts = _require(doc, "prompts", list, where)
        if not raw_prompts:
            raise ContractError(f"{where}: prompts is empty")
        for i, p in enumerate(raw_prompts):
            w = f"{where}: prompts[{i}]"
            if not isinstance(p, dict):
                raise ContractError(f"{w}: not an object")
            ids = _require(p, "tokenIds", list, w)
            lps = _require(p, "logprobs", list, w)
            if len(ids) < 2 or not all(isinstance(t, int) and t >= 0 for t in ids):
                raise ContractError(f"{w}: tokenIds must hold at least 2 non-negative integers")
            if len(lps) != len(ids):
                raise ContractError(f"{w}: logprobs has {len(lps)} entries for {len(ids)} tokens")
            if not all(lp is None or isinstance(lp, int | float) for lp in lps):
                raise ContractError(f"{w}: logprobs must be numbers (or null)")
            prompts.append(ProbePrompt(tuple(ids), tuple(lps)))
        return cls(
            version=_require(doc, "version", str, where),
            dtype=_require(doc, "dtype", str, where),
            prompts=tuple(prompts),
            extra=doc.get("extra") or {},
        )


# ---------------------------------------------------------------------------------------
# RPC results (JSON-able dicts on the wire; these classes give them names and types)
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class RefitInfo:
    vllm_version: str
    attention_backend: str
    kv_cache_dtype: str
    cudagraph_mode: str
    capabilities: tuple[str, ...]
    # Reasons this pod's configuration is not reload-safe under full CUDA graphs (the paths
    # vLLM's fix "Recompute FlashInfer BMM scales when a weight reload changes the KV scales"
    # leaves not covered). Empty means safe.
    unsafe_reasons: tuple[str, ...]
    weight_version: str
    model: str
    allowed_root: str
    # Where the quantized KV cache's scales come from when they are checkpoint parameters
    # (the quantization method, e.g. "compressed-tensors"); "" when the KV cache is not
    # quantized or uses vLLM's default scales. Sleep level 2 discards such parameters and
    # a wake does not restore them (vLLM #57163): the operator refuses level 2 for them.
    # Absent from older workers' answers: read as "".
    kv_cache_scales: str = ""
    # The engine's parallel layout (vLLM's parallel_config): one pod runs TP x PP workers per
    # data-parallel engine. Absent from older workers' answers: read as 1.
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    # LoRA adapters (an adapter refit, spec.adapter): the highest rank the engine takes (vLLM's
    # --max-lora-rank; 0: started without --enable-lora), and whether its runtime routes
    # (/v1/load_lora_adapter, /v1/unload_lora_adapter) are served
    # (VLLM_ALLOW_RUNTIME_LORA_UPDATING). Absent from older workers' answers: 0 and False.
    max_lora_rank: int = 0
    runtime_lora_updating: bool = False
    # The speculative method of a drafter the worker refits with its target from the
    # checkpoint's DRAFTER_DIR (vLLM's speculative_config.method, "draft_model"); "" when
    # the engine runs none. Absent from older workers' answers: read as "".
    drafter: str = ""
    # What the model scores: token ids from 0 below vocab_size (vLLM's model vocabulary), a
    # prompt shorter than max_model_len (one token is generated after it). The fleet preflight
    # checks a probe reference against them (core/preflight_cache.reference_fits). Absent from
    # older workers' answers: 0, unknown.
    vocab_size: int = 0
    max_model_len: int = 0

    @property
    def layout(self) -> str:
        """The layout as people write it: "TP2 PP1 DP1"."""
        return (
            f"TP{self.tensor_parallel_size} PP{self.pipeline_parallel_size} "
            f"DP{self.data_parallel_size}"
        )

    @property
    def workers(self) -> int:
        """How many workers receive a broadcast in this pod (vLLM's /get_world_size)."""
        return self.tensor_parallel_size * self.pipeline_parallel_size * self.data_parallel_size

    def to_json_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json_dict(cls, doc: Any) -> RefitInfo:
        where = RPC_INFO
        if not isinstance(doc, dict):
            raise ContractError(f"{where}: not a JSON object")
        return cls(
            vllm_version=_require(doc, "vllm_version", str, where),
            attention_backend=_require(doc, "attention_backend", str, where),
            kv_cache_dtype=_require(doc, "kv_cache_dtype", str, where),
            cudagraph_mode=_require(doc, "cudagraph_mode", str, where),
            capabilities=tuple(_require(doc, "capabilities", list, where)),
            unsafe_reasons=tuple(_require(doc, "unsafe_reasons", list, where)),
            weight_version=_require(doc, "weight_version", str, where),
            model=_require(doc, "model", str, where),
            allowed_root=_require(doc, "allowed_root", str, where),
            kv_cache_scales=_require(doc, "kv_cache_scales", str, where)
            if "kv_cache_scales" in doc
            else "",
            drafter=_require(doc, "drafter", str, where) if "drafter" in doc else "",
            **{
                key: _parallel_size(doc, key, where)
                for key in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size")
                if key in doc
            },
            max_lora_rank=_require(doc, "max_lora_rank", int, where)
            if "max_lora_rank" in doc
            else 0,
            runtime_lora_updating=_require(doc, "runtime_lora_updating", bool, where)
            if "runtime_lora_updating" in doc
            else False,
            **{
                key: _require(doc, key, int, where)
                for key in ("vocab_size", "max_model_len")
                if key in doc
            },
        )


def _parallel_size(doc: dict[str, Any], key: str, where: str) -> int:
    value = doc[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ContractError(f"{where}: {key} must be a positive integer, not {value!r}")
    return value


# ---------------------------------------------------------------------------------------
# Errors: a refit RPC that refuses raises RefitRejected; vLLM's /collective_rpc turns it
# into HTTP 500 whose body carries str(exc). The operator reads the code back with
# parse_rejection() and reports it as the pod's reason.
# ---------------------------------------------------------------------------------------
REJECTION_PREFIX = "refit-rejected"
REJECTION_CODES = (
    "PathNotAllowed",  # outside the allowed root, '..', or a symlink escape
    "CheckpointMissing",  # directory or manifest absent
    "ManifestInvalid",  # manifest unreadable or not of this contract
    "ManifestMismatch",  # files on disk differ from the manifest (size, digest, extra/missing)
    "TensorMismatch",  # a parameter the model loads is absent, or shape/dtype incompatible
    "ProbeReferenceInvalid",  # refit-probe.json missing or malformed
    "CheckpointChanged",  # a file changed (identity, size, mtime) between refit_stage and load
    "LoadFailed",  # vLLM's reload raised after preflight passed
    "AdapterInvalid",  # adapter_config.json absent, unreadable, or not a PEFT LoRA config
    # The adapter does not fit the engine (refit_worker.lora_adapter.check_adapter): its rank
    # above --max-lora-rank; a tensor of a module the served model lets no LoRA target; a
    # matrix whose size is not its module's (trained on another base model).
    "AdapterRankTooHigh",
    "AdapterModulesUnknown",
    "AdapterBaseMismatch",
    # the engine runs a drafter the worker refits, and the refit carries no drafter weights
    # (a checkpoint without a DRAFTER_DIR holding a manifest, or a broadcast without any
    # DRAFTER_PREFIX tensor): refused
    # before either model is touched (never a new target beside a stale drafter).
    "DrafterMissing",
    # Broadcast refits (docs/broadcast.md); both are refused before the model is touched:
    # what arrived differs from the promised transfer manifest (a tensor's dtype, shape or
    # digest; a promised tensor not sent, one sent but not promised, or sent twice), or
    # refit_received was asked about a digest other than the one loaded.
    "TransferMismatch",
    # no refit-gloo engine, or not initialized, or the transport broke (a timeout, a peer
    # gone, a malformed stream) before every tensor arrived.
    "TransferFailed",
)


class RefitRejected(RuntimeError):
    def __init__(self, code: str, detail: str) -> None:
        if code not in REJECTION_CODES:
            raise ValueError(f"unknown rejection code {code!r}")
        self.code = code
        self.detail = detail
        super().__init__(f"{REJECTION_PREFIX}: {code}: {detail}")


class Rejection(NamedTuple):
    """A worker's refusal as the operator reads it back from an error body."""

    code: str  # one of REJECTION_CODES
    detail: str


def parse_rejection(text: str) -> Rejection | None:
    """Find '<prefix>: <Code>: <detail>' anywhere in an error body; None if absent."""
    at = text.find(REJECTION_PREFIX + ": ")
    if at < 0:
        return None
    rest = text[at + len(REJECTION_PREFIX) + 2 :]
    code, _, detail = rest.partition(": ")
    if code not in REJECTION_CODES:
        return None
    # vLLM wraps a worker exception as "... error '<str(exc)>', please check the stack trace".
    detail = detail.split("', please check")[0]
    return Rejection(code, detail.strip().strip('"}').strip())
