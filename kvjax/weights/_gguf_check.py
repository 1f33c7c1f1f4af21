"""A bounds check of a GGUF file's header before `gguf.GGUFReader` parses it: every declared
count and length must fit in the bytes left in the file, so a corrupt size is one clear error
instead of a multi-GB allocation or a hang inside the reader."""

from __future__ import annotations

import mmap
import pathlib
import struct

_SCALAR = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_MAX_DIMS = 8


class _Walk:
    def __init__(self, buf, path: pathlib.Path):
        self.buf, self.at, self.path = buf, 0, path

    def fail(self, what: str):
        left = len(self.buf) - self.at
        raise ValueError(
            f"{self.path} is not a valid GGUF file: {what} at byte {self.at} does not fit in "
            f"the {left} bytes left (truncated or corrupt)"
        )

    def take(self, fmt: str, what: str):
        size = struct.calcsize(fmt)
        if self.at + size > len(self.buf):
            self.fail(what)
        (value,) = struct.unpack_from(fmt, self.buf, self.at)
        self.at += size
        return value

    def skip(self, n: int, what: str):
        if n < 0 or self.at + n > len(self.buf):
            self.fail(f"{what} of {n} bytes")
        self.at += n

    def string(self, what: str):
        self.skip(self.take("<Q", what), what)

    def value(self, kind: int, what: str, depth: int = 0):
        if kind in _SCALAR:
            self.skip(_SCALAR[kind], what)
        elif kind == _STRING:
            self.string(what)
        elif kind == _ARRAY and depth < 4:
            elem = self.take("<I", what)
            count = self.take("<Q", what)
            least = _SCALAR.get(elem, 8 if elem == _STRING else 12)
            if elem not in _SCALAR and elem not in (_STRING, _ARRAY):
                raise ValueError(f"{self.path} is not a valid GGUF file: {what} has type {elem}")
            if count * least > len(self.buf) - self.at:
                self.fail(f"{what}: an array of {count} elements")
            if elem in _SCALAR:
                self.skip(count * least, what)
            else:
                for _ in range(count):
                    self.value(elem, what, depth + 1)
        else:
            raise ValueError(f"{self.path} is not a valid GGUF file: {what} has type {kind}")


def check_gguf_sizes(path: pathlib.Path) -> None:
    """Raise one ValueError naming `path` when a declared count or length exceeds the file."""
    with open(path, "rb") as f:
        if path.stat().st_size < 24:
            raise ValueError(f"{path} is not a valid GGUF file: {path.stat().st_size} bytes")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
            w = _Walk(buf, path)
            if bytes(buf[:4]) != b"GGUF":
                return  # the reader reports the wrong magic itself
            w.skip(4, "magic")
            w.take("<I", "version")
            n_tensors = w.take("<Q", "the tensor count")
            n_kv = w.take("<Q", "the metadata count")
            if n_kv * 12 + n_tensors * 24 > len(buf) - w.at:
                w.fail(f"{n_kv} metadata keys and {n_tensors} tensors")
            for i in range(n_kv):
                w.string(f"metadata key {i}")
                w.value(w.take("<I", f"metadata {i}'s type"), f"metadata {i}")
            for i in range(n_tensors):
                w.string(f"tensor {i}'s name")
                n_dims = w.take("<I", f"tensor {i}'s rank")
                if n_dims > _MAX_DIMS:
                    raise ValueError(
                        f"{path} is not a valid GGUF file: tensor {i} has {n_dims} dims"
                    )
                w.skip(8 * n_dims + 4 + 8, f"tensor {i}'s shape, type and offset")
