"""The broadcast wire: how one round of tensors is framed and packed over a broadcast from
rank 0 (vLLM's ``weight_transfer/packed_tensor.py`` plays this part for its NCCL engines).

Each round is, in broadcasts from rank 0:

  1. int64[2]: WIRE_VERSION and the header's length L
  2. uint8[L]: the header, UTF-8 JSON {"tensors": [[name, dtype, shape], ...],
     "bucketBytes": B}, in send order
  3. the tensors' bytes (raw_bytes: row-major, as the transfer manifest's digests read them)
     in that order, packed into buckets of at most B bytes (a larger tensor is a bucket of
     its own), cut by plan_buckets from the header on both sides.

The header says what is on the wire, so a receiver can always drain a round whatever it was
promised: a receiver that refuses what it got never stalls the broadcast for the others.
Torch only; the group the round goes over is anything with a rank-0 ``broadcast(tensor)``
(gloo_group.Group).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from refit_worker.dtypes import dtype_name, torch_dtypes

WIRE_VERSION = 1
# Small tensors (norms, biases) share a bucket, so their per-broadcast latency does not add
# up; larger ones go alone, without a packing copy. Measured on 2 cores, 512 MiB of 1 MiB
# tensors: 16 MiB buckets ~1 GiB/s, 64 MiB ~0.7 GiB/s (fresh 64 MiB buffers are mmapped and
# faulted in for every bucket).
DEFAULT_BUCKET_BYTES = 16 * 2**20
MAX_HEADER_BYTES = 64 * 2**20


class TransportError(RuntimeError):
    """The round cannot continue: a malformed stream, a timeout, a peer gone."""


class Broadcast(Protocol):
    """One rank's end of a broadcast from rank 0 (in place on the receivers)."""

    def broadcast(self, tensor: torch.Tensor) -> None: ...


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 CPU tensor, row-major (a view when it can be)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


@dataclass(frozen=True)
class WireEntry:
    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * torch_dtypes()[self.dtype].itemsize


def encode_header(entries: list[WireEntry], bucket_bytes: int) -> bytes:
    doc = {
        "tensors": [[e.name, e.dtype, list(e.shape)] for e in entries],
        "bucketBytes": bucket_bytes,
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_header(raw: bytes) -> tuple[list[WireEntry], int]:
    """TransportError when the header is not one this wire writes."""
    try:
        doc = json.loads(raw)
        bucket_bytes = int(doc["bucketBytes"])
        entries = [
            WireEntry(str(n), str(d), tuple(int(x) for x in s)) for n, d, s in doc["tensors"]
        ]
    except (ValueError, TypeError, KeyError) as exc:
        raise TransportError(f"malformed round header: {exc}") from None
    unknown = sorted({e.dtype for e in entries} - torch_dtypes().keys())
    if unknown or bucket_bytes <= 0 or any(d < 0 for e in entries for d in e.shape):
        raise TransportError(
            f"malformed round header (dtypes {unknown}, bucketBytes {bucket_bytes})"
        )
    return entries, bucket_bytes


def plan_buckets(sizes: list[int], bucket_bytes: int) -> list[range]:
    """Consecutive index ranges of at most bucket_bytes each (a larger tensor alone)."""
    buckets: list[range] = []
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > bucket_bytes:
            buckets.append(range(start, i))
            start, total = i, 0
        total += size
    if start < len(sizes):
        buckets.append(range(start, len(sizes)))
    return buckets


def send_round(
    group: Broadcast, items: list[tuple[str, torch.Tensor]], bucket_bytes: int
) -> tuple[int, int]:
    """Rank 0's side of one round: the header, then every tensor's bytes, bucketed.
    Returns (bytes, buckets) sent."""
    entries = [WireEntry(n, dtype_name(t.dtype), tuple(int(d) for d in t.shape)) for n, t in items]
    header = encode_header(entries, bucket_bytes)
    group.broadcast(torch.tensor([WIRE_VERSION, len(header)], dtype=torch.int64))
    group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    buckets = plan_buckets([e.nbytes for e in entries], bucket_bytes)
    for bucket in buckets:
        parts = [raw_bytes(items[i][1]) for i in bucket]
        if len(parts) == 1:
            data = parts[0]
        else:  # packed with numpy's plain memcpy: torch.cat's OpenMP threads spin and
            # starve gloo's on a small host (5x slower on 2 cores)
            data = torch.empty(sum(p.numel() for p in parts), dtype=torch.uint8)
            packed, at = data.numpy(), 0
            for part in parts:
                packed[at : at + part.numel()] = part.numpy()
                at += part.numel()
        if data.numel():
            group.broadcast(data)
    return sum(e.nbytes for e in entries), len(buckets)


def receive(group: Broadcast) -> Iterator[tuple[str, torch.Tensor]]:
    """A receiver's side of one round: every tensor as its bucket arrives, in send order.
    Consume it to the end (the broadcast is lockstep); the tensors are views of the
    bucket buffers, valid as long as they are referenced."""
    head = torch.zeros(2, dtype=torch.int64)
    group.broadcast(head)
    version, length = (int(x) for x in head.tolist())
    if version != WIRE_VERSION or not 0 < length <= MAX_HEADER_BYTES:
        raise TransportError(f"unknown wire (version {version}, header {length} bytes)")
    raw = torch.empty(length, dtype=torch.uint8)
    group.broadcast(raw)
    entries, bucket_bytes = decode_header(raw.numpy().tobytes())
    for bucket in plan_buckets([e.nbytes for e in entries], bucket_bytes):
        data = torch.empty(sum(entries[i].nbytes for i in bucket), dtype=torch.uint8)
        if data.numel():
            group.broadcast(data)
        at = 0
        for i in bucket:
            e = entries[i]
            chunk = data[at : at + e.nbytes]
            dtype = torch_dtypes()[e.dtype]
            if at % dtype.itemsize:  # a view must start on an element boundary
                chunk = chunk.clone()
            at += e.nbytes
            yield e.name, chunk.view(dtype).reshape(e.shape)
