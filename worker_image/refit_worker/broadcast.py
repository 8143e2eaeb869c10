"""Broadcast refits, the half that needs only torch: manifests of tensors, the wire
protocol, and both ends of the gloo group. A trainer imports this module without vLLM;
refit_worker.transfer puts the receiving end behind vLLM's weight transfer engine interface.

The world: rank 0 is the trainer (the only sender), ranks 1..world_size-1 are inference
workers, one per vLLM worker process (a pod with tensor parallelism 2 is two ranks). The
trainer opens the rendezvous, a TCPStore server at host:port; every rank joins one gloo
process group through it. Each update is one round of broadcasts from rank 0:

  1. int64[2]: WIRE_VERSION and the header's length L
  2. uint8[L]: the header, UTF-8 JSON {"tensors": [[name, dtype, shape], ...],
     "bucketBytes": B}, in send order
  3. the tensors' bytes in that order, packed into buckets of at most B bytes (a larger tensor
     is a bucket of its own), cut by plan_buckets from the header on both sides.

The header says what is on the wire, so a receiver can always drain a round whatever it was
promised: a receiver that refuses what it got never stalls the broadcast for the others.
Whether what arrived is what the trainer promised (a contract.TransferManifest, delivered
separately) is the Verifier's job.
"""

from __future__ import annotations

import datetime
import json
import socket
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from refit_worker import checkpoint
from refit_worker.contract import TransferManifest, TransferTensor
from refit_worker.dtypes import dtype_name, torch_dtypes
from refit_worker.transfer_digest import manifest_of, tensor_digest

WIRE_VERSION = 1
# Small tensors (norms, biases) share a bucket, so their per-broadcast latency does not add
# up; larger ones go alone, without a packing copy. Measured on 2 cores, 512 MiB of 1 MiB
# tensors: 16 MiB buckets ~1 GiB/s, 64 MiB ~0.7 GiB/s (fresh 64 MiB buffers are mmapped and
# faulted in for every bucket).
DEFAULT_BUCKET_BYTES = 16 * 2**20
DEFAULT_TIMEOUT_SECONDS = 600.0
MAX_HEADER_BYTES = 64 * 2**20
_STORE_PREFIX = "refit-gloo"


class TransportError(RuntimeError):
    """The round cannot continue: a malformed stream, a timeout, a peer gone."""


# ---------------------------------------------------------------------------------------
# Manifests of torch tensors (the digests: refit_worker.transfer_digest)
# ---------------------------------------------------------------------------------------
def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as a flat uint8 CPU tensor, row-major (a view when it can be)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8)


def digest_tensor(name: str, tensor: torch.Tensor) -> TransferTensor:
    data = raw_bytes(tensor)
    dtype, shape = dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape)
    return TransferTensor(dtype, shape, tensor_digest(name, dtype, shape, data.numpy()))


def build_manifest(tensors: Mapping[str, torch.Tensor]) -> TransferManifest:
    """The promise for a broadcast of `tensors` (any device: each is copied to the CPU to be
    hashed, one at a time)."""
    return manifest_of({name: digest_tensor(name, t) for name, t in tensors.items()})


def load_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """Every tensor of a directory of safetensors shards (a checkpoint), on the CPU."""
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for shard in checkpoint.safetensors_files(Path(directory)):
        tensors.update(load_file(str(shard)))
    return tensors


# ---------------------------------------------------------------------------------------
# Wire protocol
# ---------------------------------------------------------------------------------------
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


# ---------------------------------------------------------------------------------------
# The gloo group
# ---------------------------------------------------------------------------------------
def address_towards(host: str, port: int) -> str:
    """This machine's address on the route to host (no packet is sent): the address the
    other ranks can reach this one at, without trusting the hostname's resolution."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return str(s.getsockname()[0])


class Group:
    """One rank's membership of the transfer's gloo process group. The group is made from a
    TCPStore of its own and never touches torch.distributed's default group, which vLLM uses
    for its own workers."""

    def __init__(
        self,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        *,
        local_address: str | None = None,
        store: Any = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside the world of {world_size}")
        timeout = datetime.timedelta(seconds=timeout_seconds)
        if store is None:  # a receiver: connect to the trainer's store (retried until timeout)
            store = torch.distributed.TCPStore(host, port, world_size, False, timeout=timeout)
        self.store = store
        self.rank, self.world_size = rank, world_size
        # An explicit device: gloo's default resolves the hostname, which in a container may
        # name an address the other ranks cannot reach (or 127.0.1.1).
        pg_gloo: Any = torch.distributed.ProcessGroupGloo  # _Options is not in the stubs
        options = pg_gloo._Options()
        options._timeout = timeout
        options._devices = [
            pg_gloo.create_device(hostname=local_address or address_towards(host, port))
        ]
        prefixed = torch.distributed.PrefixStore(_STORE_PREFIX, store)
        self.pg: Any = pg_gloo(prefixed, rank, world_size, options)  # waits for every rank

    def broadcast(self, tensor: torch.Tensor) -> None:
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        try:
            self.pg.broadcast([tensor], options).wait()
        except RuntimeError as exc:  # gloo reports timeouts and lost peers this way
            raise TransportError(f"gloo broadcast failed: {exc}") from exc

    def close(self) -> None:
        pg, self.pg = self.pg, None
        if pg is not None and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except RuntimeError:
                pass  # already broken; dropping it is all that is left


@dataclass(frozen=True)
class SendStats:
    tensors: int
    bytes: int
    buckets: int
    seconds: float

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "tensors": self.tensors,
            "bytes": self.bytes,
            "buckets": self.buckets,
            "seconds": round(self.seconds, 4),
        }


class Sender:
    """The trainer's end: rank 0 of the transfer's world.

    ``Sender(world_size, host=, port=)`` opens the rendezvous at once (port 0: a free one,
    see ``.port``), ``init_info(rank_offset)`` is the body a pod's
    ``/init_weight_transfer_engine`` takes, ``connect()`` waits until every receiver has
    joined (call it while the pods' init calls are in flight: they wait for it too), and
    each ``send(tensors)`` is one round; the pods must be inside ``/update_weights`` for it.
    """

    def __init__(
        self,
        world_size: int,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_seconds: float = DEFAULT_TIMEOUT_SECONDS,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    ) -> None:
        if world_size < 2:
            raise ValueError("a broadcast needs at least one receiver (world_size >= 2)")
        self.host, self.world_size = host, world_size
        self.timeout_seconds, self.bucket_bytes = timeout_seconds, bucket_bytes
        # Bind the socket ourselves: the store listens on exactly this address (not on every
        # interface) and a free port is taken without a race. The store owns the socket's
        # descriptor from then on (it closes it when it goes).
        listen = socket.create_server((host, port))
        self.port = int(listen.getsockname()[1])
        try:
            self._store: torch.distributed.TCPStore | None = torch.distributed.TCPStore(
                host,
                self.port,
                world_size,
                True,
                timeout=datetime.timedelta(seconds=timeout_seconds),
                wait_for_workers=False,
                master_listen_fd=listen.fileno(),
            )
        except BaseException:
            listen.close()
            raise
        listen.detach()
        self.group: Group | None = None

    def init_info(self, rank_offset: int, **extra: Any) -> dict[str, Any]:
        """The refit-gloo init info for a pod whose first worker is rank `rank_offset`."""
        return {
            "master_address": self.host,
            "master_port": self.port,
            "rank_offset": rank_offset,
            "world_size": self.world_size,
            "timeout_seconds": self.timeout_seconds,
            **extra,
        }

    def connect(self) -> None:
        if self.group is None:
            self.group = Group(
                self.host, self.port, 0, self.world_size, self.timeout_seconds, store=self._store
            )

    def send(
        self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    ) -> SendStats:
        """One round: the header, then every tensor's bytes, bucketed."""
        self.connect()
        assert self.group is not None
        started = time.perf_counter()
        items = list(tensors.items() if isinstance(tensors, Mapping) else tensors)
        entries = [
            WireEntry(n, dtype_name(t.dtype), tuple(int(d) for d in t.shape)) for n, t in items
        ]
        header = encode_header(entries, self.bucket_bytes)
        self.group.broadcast(torch.tensor([WIRE_VERSION, len(header)], dtype=torch.int64))
        self.group.broadcast(torch.frombuffer(bytearray(header), dtype=torch.uint8))
        buckets = plan_buckets([e.nbytes for e in entries], self.bucket_bytes)
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
                self.group.broadcast(data)
        total = sum(e.nbytes for e in entries)
        return SendStats(len(items), total, len(buckets), time.perf_counter() - started)

    def close(self) -> None:
        if self.group is not None:
            self.group.close()
            self.group = None
        self._store = None  # its server (and the listening socket) go with it

    def __enter__(self) -> Sender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def receive(group: Group) -> Iterator[tuple[str, torch.Tensor]]:
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


# ---------------------------------------------------------------------------------------
# Checking a round against the promise
# ---------------------------------------------------------------------------------------
_MAX_LISTED = 5  # problems named in a refusal; the count says how many more


class Verifier:
    """Checks every tensor as it arrives against the promised manifest, and records what
    arrived. With no promise (it was refused) nothing passes, but the record is kept."""

    def __init__(self, promise: TransferManifest | None) -> None:
        self.promise = promise
        self.received: dict[str, TransferTensor] = {}
        self.bytes = 0
        self.problems: list[str] = []

    def check(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether this tensor is exactly the one promised (its bytes hashed here)."""
        got = digest_tensor(name, tensor)
        self.bytes += tensor.numel() * tensor.element_size()
        if name in self.received:
            self.problems.append(f"{name} was sent twice")
            return False
        self.received[name] = got
        if self.promise is None:
            return False
        want = self.promise.tensors.get(name)
        if want is None:
            self.problems.append(f"{name} was sent but not promised")
        elif (want.dtype, want.shape) != (got.dtype, got.shape):
            self.problems.append(
                f"{name} is {got.dtype}{list(got.shape)}, promised {want.dtype}{list(want.shape)}"
            )
        elif want.digest != got.digest:
            self.problems.append(
                f"{name}: its bytes differ from the promise (blake3 {got.digest[:16]}…, "
                f"promised {want.digest[:16]}…)"
            )
        else:
            return True
        return False

    def manifest(self) -> TransferManifest:
        """What arrived, as a manifest (its digest is the manifest digest of what arrived)."""
        return manifest_of(self.received)

    def refusal(self) -> str | None:
        """Why the round does not match the promise; None when it does, exactly."""
        problems = list(self.problems)
        if self.promise is not None:
            missing = sorted(self.promise.tensors.keys() - self.received.keys())
            if missing:
                more = (
                    f" and {len(missing) - _MAX_LISTED} more" if len(missing) > _MAX_LISTED else ""
                )
                problems.append(f"promised but not sent: {', '.join(missing[:_MAX_LISTED])}{more}")
            elif not problems and self.manifest().digest != self.promise.digest:
                problems.append("the received digest differs from the promise")  # unreachable
        if not problems:
            return None
        shown = "; ".join(problems[:_MAX_LISTED])
        hidden = len(problems) - _MAX_LISTED
        return shown + (f"; and {hidden} more problems" if hidden > 0 else "")
