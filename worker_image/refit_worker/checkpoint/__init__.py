"""Checkpoints on disk: a directory of safetensors shards and its refit-manifest.json.

No vLLM and no torch, so the trainer-side CLI, the operator's client, the worker extension
and the tests share it. One mechanism per module:

- safetensors_header: the tensors a shard holds, from its header alone;
- digests: file digests, hashed in parallel on the process's cores and remembered by
  file identity;
- manifest: write a checkpoint's manifest, and verify a directory against its own (the
  path rules, files, sizes, digests, tensors);
- staging: verify while the pod serves and hold the verified bytes for the load, within
  the staging budget, with the identities the load re-checks.

The names below are the package's interface; its modules import each other, never this file.
"""

from refit_worker.checkpoint.digests import (
    FileIdentity,
    file_digest,
    file_digest_memo,
    hash_workers,
    process_cpus,
)
from refit_worker.checkpoint.manifest import (
    build_manifest,
    load_manifest,
    resolve_under_root,
    verify_checkpoint,
    verify_files,
    write_manifest,
)
from refit_worker.checkpoint.safetensors_header import (
    MAX_HEADER_BYTES,
    SAFETENSORS_SUFFIX,
    parse_safetensors_header,
    read_safetensors_header,
    safetensors_files,
)
from refit_worker.checkpoint.staging import (
    DEFAULT_STAGING_BUDGET,
    STAGING_BUDGET_ENV,
    CheckpointIdentity,
    StagedCheckpoint,
    format_bytes,
    parse_staging_budget,
    stage_checkpoint,
    staging_budget,
)

# Not the checkpoint's: what a model expects of any tensors (refit_worker.model_tensors).
# Re-exported because the simulated worker (testbed/simworker/) imports them from here.
from refit_worker.model_tensors import ExpectedParam, verify_params

__all__ = [
    "DEFAULT_STAGING_BUDGET",
    "MAX_HEADER_BYTES",
    "SAFETENSORS_SUFFIX",
    "STAGING_BUDGET_ENV",
    "CheckpointIdentity",
    "ExpectedParam",
    "FileIdentity",
    "StagedCheckpoint",
    "build_manifest",
    "file_digest",
    "file_digest_memo",
    "format_bytes",
    "hash_workers",
    "load_manifest",
    "parse_safetensors_header",
    "parse_staging_budget",
    "process_cpus",
    "read_safetensors_header",
    "resolve_under_root",
    "safetensors_files",
    "stage_checkpoint",
    "staging_budget",
    "verify_checkpoint",
    "verify_files",
    "verify_params",
    "write_manifest",
]
