"""The safetensors header: the tensors a shard holds, read without reading their bytes.

A safetensors file starts with an 8-byte little-endian header length and a JSON header naming
every tensor's dtype, shape and byte range; reading that header is all a checkpoint's
verification needs besides hashing the bytes. Standard library only.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

from refit_worker.contract import ManifestTensor
from refit_worker.dtypes import DTYPE_BYTES

SAFETENSORS_SUFFIX = ".safetensors"
# A header larger than this is not a checkpoint we wrote; refuse instead of reading it whole.
MAX_HEADER_BYTES = 100 * 1024 * 1024


def safetensors_files(directory: Path) -> list[Path]:
    """The directory's shards, by name (the loader reads every one, listed or not)."""
    return sorted(p for p in directory.iterdir() if p.name.endswith(SAFETENSORS_SUFFIX))


def read_safetensors_header(path: Path) -> dict[str, ManifestTensor]:
    """Tensor name -> (file, dtype, shape) from a safetensors file's header.

    Raises ValueError with the reason when the file is not a well-formed safetensors file
    (too short, header length past the end, tensor byte ranges outside the data).
    """
    size = path.stat().st_size
    with path.open("rb") as f:
        return _parse_safetensors_header(path.name, size, f.read)


def parse_safetensors_header(name: str, data: bytes) -> dict[str, ManifestTensor]:
    """read_safetensors_header of a file held in memory (`name`: its file name)."""
    view = memoryview(data)
    at = 0

    def read(n: int) -> bytes:
        nonlocal at
        chunk = bytes(view[at : at + n])
        at += len(chunk)
        return chunk

    return _parse_safetensors_header(name, len(data), read)


def _parse_safetensors_header(
    name: str, size: int, read: Callable[[int], bytes]
) -> dict[str, ManifestTensor]:
    raw_len = read(8)
    if len(raw_len) != 8:
        raise ValueError(f"{name}: {size} bytes is too short for a safetensors header")
    (header_len,) = struct.unpack("<Q", raw_len)
    if header_len > MAX_HEADER_BYTES or 8 + header_len > size:
        raise ValueError(f"{name}: header length {header_len} exceeds the file")
    try:
        header = json.loads(read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{name}: header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{name}: header is not a JSON object")
    data_len = size - 8 - header_len
    tensors: dict[str, ManifestTensor] = {}
    for tname, info in header.items():
        if tname == "__metadata__":
            continue
        try:
            dtype = str(info["dtype"])
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{name}: tensor {tname!r} has a malformed header entry") from None
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"{name}: tensor {tname!r} has unknown dtype {dtype}")
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_len or end - begin != numel * DTYPE_BYTES[dtype]:
            raise ValueError(
                f"{name}: tensor {tname!r} byte range {begin}..{end} does not fit "
                f"{dtype}{list(shape)} inside {data_len} data bytes"
            )
        tensors[tname] = ManifestTensor(file=name, dtype=dtype, shape=shape)
    return tensors
