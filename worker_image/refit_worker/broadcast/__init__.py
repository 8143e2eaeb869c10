"""Broadcast refits: weights sent from the trainer's memory over the network (docs/broadcast.md).

The names below are the trainer's interface, torch only: a trainer imports this package
without vLLM. One mechanism per module, named as vLLM names the parts of its own weight
transfer engines (``vllm/distributed/weight_transfer/``):

- packed_tensor: the wire, how one round of tensors is framed and bucketed;
- gloo_group: the transfer's gloo process group (rendezvous, ranks, addresses);
- promise: the transfer manifest made from torch tensors, and checked as they arrive;
- sender: the trainer's end (rank 0), and load_tensors for a trainer that sends a checkpoint;
  with_drafter (from transfer_manifest) adds a draft_model drafter's tensors to a transfer;
- gloo_engine: the ``refit-gloo`` engine of vLLM's workers, the receiving end (needs vLLM);
- gloo_trainer: the same transport behind vLLM's trainer-side engine interface (needs vLLM).

The digests the promise is made of are refit_worker.transfer_manifest's (no torch). The
modules import each other, never this file; the two vLLM modules are imported only where an
engine is made (refit_worker.plugin registers them by module path).
"""

from refit_worker.broadcast.gloo_group import DEFAULT_TIMEOUT_SECONDS, Group, address_towards
from refit_worker.broadcast.packed_tensor import (
    DEFAULT_BUCKET_BYTES,
    MAX_HEADER_BYTES,
    WIRE_VERSION,
    TransportError,
    WireEntry,
    decode_header,
    encode_header,
    plan_buckets,
    raw_bytes,
    receive,
)
from refit_worker.broadcast.promise import Verifier, build_manifest, digest_tensor
from refit_worker.broadcast.sender import Sender, SendStats, load_tensors, model_tensors
from refit_worker.transfer_manifest import split_drafter, with_drafter

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_TIMEOUT_SECONDS",
    "MAX_HEADER_BYTES",
    "WIRE_VERSION",
    "Group",
    "SendStats",
    "Sender",
    "TransportError",
    "Verifier",
    "WireEntry",
    "address_towards",
    "build_manifest",
    "decode_header",
    "digest_tensor",
    "encode_header",
    "load_tensors",
    "model_tensors",
    "plan_buckets",
    "raw_bytes",
    "receive",
    "split_drafter",
    "with_drafter",
]
