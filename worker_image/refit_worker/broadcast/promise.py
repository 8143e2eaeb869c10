"""The promise of a broadcast (a contract.TransferManifest) on torch tensors: made from the
trainer's tensors before they are sent, and checked against every tensor as it arrives. The
digests themselves are refit_worker.transfer_manifest's, on the wire's bytes (raw_bytes).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from refit_worker.broadcast.packed_tensor import raw_bytes
from refit_worker.contract import TransferManifest, TransferTensor
from refit_worker.dtypes import dtype_name
from refit_worker.transfer_manifest import manifest_of, tensor_digest


def digest_tensor(name: str, tensor: torch.Tensor) -> TransferTensor:
    data = raw_bytes(tensor)
    dtype, shape = dtype_name(tensor.dtype), tuple(int(d) for d in tensor.shape)
    return TransferTensor(dtype, shape, tensor_digest(name, dtype, shape, data.numpy()))


def build_manifest(tensors: Mapping[str, torch.Tensor]) -> TransferManifest:
    """The promise for a broadcast of `tensors` (any device: each is copied to the CPU to be
    hashed, one at a time)."""
    return manifest_of({name: digest_tensor(name, t) for name, t in tensors.items()})


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
