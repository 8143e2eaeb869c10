"""The simulated model, and the checkpoints and adapters it loads.

A pod starts at weight version ``"default"`` with dummy weights: every token scores
ln(1/vocab) (``vocab=`` of the fleet, default SIM_VOCAB), as a real dummy-loaded vLLM
does; larger token ids answer 400. ``make_sim_checkpoint(dir, version, drift=d)``
writes a checkpoint (one small safetensors file, ``refit-manifest.json`` and
``refit-probe.json``) whose "weights" score any token ids with :func:`sim_logprobs` of
its version, plus ``d`` per token. Its refit-probe.json holds the drift-free scores, so a
probe against the reference of the checkpoint a pod last loaded passes exactly unless a
drift or fault is injected. ``make_sim_adapter(dir, version, drift=d, rank=r)`` writes a
LoRA adapter (PEFT's ``adapter_config.json`` of rank r, one small safetensors file,
manifest and probe reference); a completion with ``model=<name>`` of a loaded adapter
scores :func:`sim_logprobs` of its version plus ``d`` (the probe reference is drift-free).
How a pod loads them: testbed.simworker.extension (checkpoints, through the refit_worker
RPCs) and testbed.simworker.routes (adapters, through vLLM's LoRA routes).

What a CPU server cannot show (SIM_UNSHOWN; the contract test cannot hold the simulator to it)
    vLLM on CPU ignores sleep in its worker: the weights stay where they are. The simulator
    models the GPU behaviour instead: sleep level 2 discards the weights, so until the next
    successful load every score is garbage. And a LoRA-enabled CPU server's engine dies on a
    completion of several prompt-logprob sequences through an adapter, which the simulator
    scores (as a GPU server does; the client sends such prompts one per request). These,
    and nothing else it serves, are claims about vLLM that no test compares with a real
    server.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

from refit_worker import contract
from refit_worker.checkpoint import ExpectedParam, write_manifest
from refit_worker.contract import ADAPTER_CONFIG_FILE
from refit_worker.reference import write_reference

SIM_VOCAB = 512
SIM_MAX_MODEL_LEN = 512  # /v1/models and refit_info: a prompt must be shorter
SIM_MODEL = "sim-model"
SIM_MODEL_ROOT = "/models/sim-model"
SIM_WEIGHTS_FILE = "model.safetensors"
SIM_TENSOR = "sim.weight"
SIM_ADAPTER_FILE = "adapter_model.safetensors"  # PEFT's name for an adapter's weights
SIM_ADAPTER_TARGETS = ("q_proj", "v_proj")  # what testbed/tiny_adapter.py targets
# The modules a LoRA may target in the simulated model and their (input, output) features, as
# refit_worker.extension reports a Llama-like model's (packed qkv_proj and gate_up_proj expanded
# into their parts): make_sim_adapter's matrices fit them.
SIM_LORA_MODULES = {
    name: (2, 2)
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
}
# What the simulated model loads: preflight compares a checkpoint with this.
SIM_PARAMS = {SIM_TENSOR: ExpectedParam(dtype="F32", shape=(2,))}
SIM_VLLM_VERSION = "0.32.0+sim"
SIM_TOKEN_SECONDS = 0.0025  # per generated token after the first
# A drafter on weights other than those trained with the target's: the share of its greedy
# drafts accepted (tests/worker/test_drafter.py measured 0.32-0.46 on vLLM CPU; 1.00 fresh).
SIM_STALE_DRAFT_RATE = 0.4
# Behaviours of real vLLM that the simulator models but a vLLM CPU server cannot show, so
# tests/worker/test_contract.py cannot compare them (see this module's docstring).
SIM_UNSHOWN = {
    "sleep level 2 discards the weights (scores are garbage until the next load)": (
        "vLLM's CPU worker ignores sleep: its weights survive every level"
    ),
    "several prompts in one completions request through a LoRA adapter are scored": (
        "on a LoRA-enabled vLLM 0.32 CPU server such a batch of prompt-logprob sequences "
        "kills the engine (punica_cpu add_lora_logits); the client sends one per request"
    ),
}
# The simulated model's tensors as vLLM's weight checker keys them (one worker, rank 0).
SIM_RANK_PREFIX = "dp0:pp0:pcp0:tp0:"
SIM_BUFFER = "sim.rotary_cache"


def sim_logprobs(seed: str, token_ids: list[int] | tuple[int, ...]) -> list[float | None]:
    """The simulated model's teacher-forced logprobs: deterministic in (seed, tokens)."""
    out: list[float | None] = [None]
    for i in range(1, len(token_ids)):
        key = f"{seed}|{i}|{token_ids[i - 1]}|{token_ids[i]}".encode()
        u = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big") / 2**64
        out.append(-0.5 - 7.5 * u)
    return out


def make_sim_checkpoint(
    dir: Path, version: str, *, drift: float = 0.0, prompts: int = 3, length: int = 24,
    drafter: str | None = None,
) -> Path:  # fmt: skip
    """Write a checkpoint directory the simulator loads (weights, manifest, probe reference).

    ``drift`` is added to every logprob a pod scores after loading it; the reference in
    refit-probe.json stays drift-free, so a non-zero drift makes the probe see it.
    ``drafter``: also a drafter's checkpoint in ``drafter/`` (contract.DRAFTER_DIR) trained
    with the target of that version (``version`` for a fresh drafter; another: a stale one).
    """
    _write_sim_weights(dir, version, drift)
    _write_sim_probe(dir, version, prompts, length)
    if drafter is not None:
        _write_sim_weights(dir / contract.DRAFTER_DIR, drafter)
    return dir


def _write_sim_weights(dir: Path, seed: str, drift: float = 0.0) -> None:
    """The simulated model's one tensor, its seed and drift in the header, and the manifest."""
    import numpy as np
    from safetensors.numpy import save_file  # only the test process writes checkpoints

    dir.mkdir(parents=True, exist_ok=True)
    save_file(
        {SIM_TENSOR: np.zeros(2, dtype=np.float32)},
        str(dir / SIM_WEIGHTS_FILE),
        metadata={"seed": seed, "drift": repr(float(drift))},
    )
    write_manifest(dir)


def make_sim_adapter(
    dir: Path, version: str, *, drift: float = 0.0, rank: int = 8, prompts: int = 3,
    length: int = 24,
) -> Path:  # fmt: skip
    """Write a LoRA adapter directory the simulator loads: its weights (one small safetensors
    file in PEFT's naming), a PEFT ``adapter_config.json`` of rank ``rank``, the manifest and
    the probe reference.

    A completion through the loaded adapter scores any token ids with :func:`sim_logprobs`
    of its version, plus ``drift`` per token; refit-probe.json stays drift-free (as in
    :func:`make_sim_checkpoint`).
    """
    import numpy as np
    from safetensors.numpy import save_file  # only the test process writes adapters

    dir.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for target in SIM_ADAPTER_TARGETS:
        prefix = f"base_model.model.model.layers.0.self_attn.{target}"
        tensors[f"{prefix}.lora_A.weight"] = np.zeros((rank, 2), dtype=np.float32)
        tensors[f"{prefix}.lora_B.weight"] = np.zeros((2, rank), dtype=np.float32)
    save_file(
        tensors,
        str(dir / SIM_ADAPTER_FILE),
        metadata={"seed": version, "drift": repr(float(drift))},
    )
    config = {  # the keys testbed/tiny_adapter.py writes
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": SIM_MODEL_ROOT,
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(SIM_ADAPTER_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "modules_to_save": None,
    }
    (dir / ADAPTER_CONFIG_FILE).write_text(json.dumps(config, indent=1) + "\n")
    write_manifest(dir)
    _write_sim_probe(dir, version, prompts, length)
    return dir


def _write_sim_probe(dir: Path, version: str, prompts: int, length: int) -> None:
    """refit-probe.json: seeded prompts scored drift-free with the version's sim_logprobs."""
    rng = random.Random(version)
    probe_prompts = []
    for _ in range(prompts):
        ids = tuple(rng.randrange(2, SIM_VOCAB) for _ in range(length))
        probe_prompts.append(contract.ProbePrompt(ids, tuple(sim_logprobs(version, ids))))
    reference = contract.ProbeReference(
        version=version, dtype="float32", prompts=tuple(probe_prompts), extra={"tool": "simworker"}
    )
    write_reference(dir, reference)


def read_sim_weights(directory: Path, name: str = SIM_WEIGHTS_FILE) -> tuple[str, float]:
    """(seed, drift) from the metadata of a checkpoint's (or adapter's) safetensors header."""
    with (directory / name).open("rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
        return sim_weights(f.read(header_len), name)


def sim_weights(header: bytes, name: str = SIM_WEIGHTS_FILE) -> tuple[str, float]:
    """(seed, drift) from a safetensors header (the JSON after the length)."""
    meta = json.loads(header).get("__metadata__") or {}
    if "seed" not in meta:
        raise contract.RefitRejected("LoadFailed", f"{name} is not a sim checkpoint")
    return str(meta["seed"]), float(meta.get("drift", 0.0))
