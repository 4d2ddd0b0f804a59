"""Streaming reads and writes of the safetensors format, one tensor at a time.

Why not safetensors.torch.save_file / safe_open: save_file serializes every tensor of the
file into host memory before writing (a second copy of the rank's whole share), and
safe_open maps the file, so every page a rank reads stays in its resident memory until the
file is closed. A checkpoint rank must never hold more than its own state plus one tensor
([Note: checkpoint memory] in checkpoint.py), so this module writes each tensor's bytes
straight from the tensor and reads them straight into the destination tensor. The files are
plain safetensors (the tests read them with the safetensors library and transformers).

Layout: 8 bytes (little-endian u64) header length, a JSON header {name: {dtype, shape,
data_offsets: [begin, end]}, "__metadata__": {str: str}} padded with spaces to 8 bytes,
then the tensors' bytes back to back.
"""
from __future__ import annotations

import json
import os
import struct
import zlib

import torch

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
    torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2",
}
_TORCH = {v: k for k, v in _DTYPES.items()}
# Bytes are written, read and checksummed in pieces of this size: the checksum reads each
# piece while it is in the CPU's cache (CRC-32 adds about a quarter to a write, a sha256
# about as much as the write itself, measured).
_PIECE = 1 << 20


def dtype_name(dtype: torch.dtype) -> str:
    """The safetensors name of a torch dtype ('F32')."""
    if dtype not in _DTYPES:
        raise TypeError(f"safetensors cannot store {dtype}")
    return _DTYPES[dtype]


def torch_dtype(name: str) -> torch.dtype:
    if name not in _TORCH:
        raise TypeError(f"unknown safetensors dtype {name!r}")
    return _TORCH[name]


def _nbytes(shape, dtype) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n * torch.empty((), dtype=dtype).element_size()


def _host_bytes(t: torch.Tensor):
    """A uint8 numpy view of `t`'s bytes on the host: no copy for a contiguous CPU tensor,
    one tensor's copy otherwise."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1).view(torch.uint8).numpy()


def write_file(path: str, tensors: list[tuple[str, torch.Tensor]],
               metadata: dict[str, str] | None = None) -> dict[str, str]:
    """Writes `tensors` (name, tensor) in this order to a safetensors file at `path` and
    makes it durable (fsync). Returns the CRC-32 of each tensor's bytes (8 hex digits), by
    name."""
    header, offset = {}, 0
    for name, t in tensors:
        size = _nbytes(t.shape, t.dtype)
        header[name] = {"dtype": dtype_name(t.dtype), "shape": list(t.shape),
                        "data_offsets": [offset, offset + size]}
        offset += size
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    checksums = {}
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, t in tensors:
            data, crc = memoryview(_host_bytes(t)), 0
            for i in range(0, len(data), _PIECE):  # checksummed while in the cache
                piece = data[i:i + _PIECE]
                crc = zlib.crc32(piece, crc)
                f.write(piece)
            checksums[name] = f"{crc:08x}"
        f.flush()
        os.fsync(f.fileno())
    return checksums


class Reader:
    """One safetensors file, its header parsed; tensors are read on demand."""

    def __init__(self, path: str):
        self.path = path
        self._file = open(path, "rb")
        size = os.fstat(self._file.fileno()).st_size
        head = self._file.read(8)
        if len(head) < 8:
            raise ValueError(f"{path} is not a safetensors file (only {size} bytes)")
        (n,) = struct.unpack("<Q", head)
        if n > size - 8:
            raise ValueError(f"{path} is not a safetensors file or is truncated (header of "
                             f"{n} bytes in a file of {size})")
        header = json.loads(self._file.read(n))
        self.metadata = header.pop("__metadata__", {}) or {}
        self._data_start = 8 + n
        self.entries = header  # name -> {dtype, shape, data_offsets}
        end = max((e["data_offsets"][1] for e in header.values()), default=0)
        if self._data_start + end > size:
            raise ValueError(f"{path} is truncated: its header needs {self._data_start + end} "
                             f"bytes, the file has {size}")

    def keys(self):
        return self.entries.keys()

    def shape(self, name: str) -> torch.Size:
        return torch.Size(self.entries[name]["shape"])

    def dtype(self, name: str) -> torch.dtype:
        return torch_dtype(self.entries[name]["dtype"])

    def read_into(self, name: str, dest: torch.Tensor | None = None) -> tuple[torch.Tensor, str]:
        """Reads tensor `name` into `dest` (copying into it, cast to its dtype and device, when
        it is not a contiguous CPU tensor of the stored dtype) or into a new CPU tensor.
        Returns (the tensor read into, the CRC-32 of the stored bytes as write_file gives it)."""
        entry = self.entries[name]
        shape, dtype = self.shape(name), self.dtype(name)
        begin, end = entry["data_offsets"]
        direct = (dest is not None and dest.device.type == "cpu" and dest.dtype == dtype
                  and dest.is_contiguous() and dest.shape == shape)
        target = dest if direct else torch.empty(shape, dtype=dtype)
        view = memoryview(target.detach().reshape(-1).view(torch.uint8).numpy())
        if len(view) != end - begin:
            raise ValueError(f"{self.path}: tensor {name} holds {end - begin} bytes, but "
                             f"{list(shape)} x {dtype} needs {len(view)}")
        self._file.seek(self._data_start + begin)
        done, crc = 0, 0
        while done < len(view):
            got = self._file.readinto(view[done:done + _PIECE])
            if not got:
                raise ValueError(f"{self.path} ends inside tensor {name}")
            crc = zlib.crc32(view[done:done + got], crc)
            done += got
        if dest is not None and not direct:
            with torch.no_grad():
                dest.copy_(target)
            target = dest
        return target, f"{crc:08x}"

    def close(self):
        self._file.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
