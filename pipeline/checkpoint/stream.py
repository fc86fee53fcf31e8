"""A .safetensors file written one tensor at a time, hashed as it is written.

safetensors' own `save_file` needs every tensor of a file in memory at once and then copies each
into a bytes object, so a writer holds about twice the file. The format
(https://huggingface.co/docs/safetensors/index, "Format") is an 8-byte little-endian header
length, a JSON header naming each tensor's dtype, shape and [begin, end) byte range, then the raw
little-endian bytes. Every shape is known before any data, so the header goes first and each
tensor's bytes follow as the caller produces them: at most one tensor is in memory. Readers
(safetensors' parser, transformers) see an ordinary file.
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from pipeline.dtypes import SAFETENSORS_CODES, SAFETENSORS_NAMES

# Reading or writing every byte of a checkpoint (export, verify): a progress bar from this size on.
PROGRESS_MIN_BYTES = 1 << 30

HEADER_ALIGN = 8  # the header is padded with spaces so the data starts 8-byte aligned


@dataclass(frozen=True)
class Entry:
    """One tensor of the file, as declared in the header before its data is written."""

    name: str
    dtype: str  # torch dtype name: float32, bfloat16, …
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        import torch

        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


def entry_of(name: str, tensor) -> Entry:
    """The Entry a tensor (or DTensor: its global shape) will be written as."""
    return Entry(name, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape))


@dataclass(frozen=True)
class Layout:
    """Where everything goes in the file: the header bytes, then each tensor's absolute offset."""

    header: bytes
    offsets: dict[str, int]
    size: int


def layout(entries: list[Entry], metadata: dict[str, str] | None = None, name: str = "file") -> Layout:
    header, offset = {}, 0
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    starts = {}
    for entry in entries:
        if entry.dtype not in SAFETENSORS_CODES:
            raise ValueError(f"{entry.name}: dtype {entry.dtype} has no safetensors code")
        header[entry.name] = {"dtype": SAFETENSORS_CODES[entry.dtype], "shape": list(entry.shape),
                              "data_offsets": [offset, offset + entry.nbytes]}
        starts[entry.name] = offset
        offset += entry.nbytes
    if len(header) != len(entries) + bool(metadata):
        raise ValueError(f"{name}: a tensor name is given twice")
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
    head = len(text).to_bytes(8, "little") + text
    return Layout(head, {k: len(head) + v for k, v in starts.items()}, len(head) + offset)


# What safetensors' save_file (and so save_pretrained) puts in every header's __metadata__; torch's HF
# consolidation (DCP's HuggingFaceStorageWriter, torchtitan's HF writer) writes no __metadata__ at all.
PT_METADATA = {"format": "pt"}


def header_metadata(path: Path) -> dict:
    """A .safetensors file's __metadata__ (empty when it has none); only the header is read."""
    with open(path, "rb") as handle:
        size = int.from_bytes(handle.read(8), "little")
        return dict(json.loads(handle.read(size)).get("__metadata__") or {})


def has_pt_format(path: Path) -> bool:
    return header_metadata(path).get("format") == PT_METADATA["format"]


def copy_with_metadata(source: Path, target: Path, metadata: dict[str, str]) -> None:
    """`source` copied to `target` with `metadata` merged into its header's __metadata__: the same tensors
    byte for byte, as their data_offsets count from the end of the header (the format's "Format"
    section), so a longer header moves no offset. Validate `source` with safetensors' parser first
    (hf_dir.read_header). Not atomic by itself: the caller renames `target` into place."""
    import shutil

    with open(source, "rb") as src:
        size = int.from_bytes(src.read(8), "little")
        header = json.loads(src.read(size))
        merged = {**(header.pop("__metadata__", None) or {}), **{str(k): str(v) for k, v in metadata.items()}}
        text = json.dumps({"__metadata__": merged, **header}, separators=(",", ":")).encode()
        text += b" " * (-(len(text) + 8) % HEADER_ALIGN)
        try:
            with open(target, "wb") as dst:
                dst.write(len(text).to_bytes(8, "little") + text)
                shutil.copyfileobj(src, dst, 16 << 20)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise OSError(errno.ENOSPC, "No space left on device", str(target)) from err
            raise


def tensor_bytes(tensor) -> memoryview:
    """A tensor's bytes as safetensors stores them (C order, little-endian), without a copy when
    it is already contiguous on the CPU."""
    return memoryview(tensor.detach().to("cpu").contiguous().reshape(-1).view(dtype=_uint8()).numpy())


class SafetensorsWriter:
    """Writes `entries` in order: `write(tensor)` once per entry, then `close()` (returns the sha256).

    Writing and hashing run in threads of their own (both release the GIL), so the caller reads
    and converts the next tensor meanwhile; at most `depth` tensors wait in each. Raises OSError(ENOSPC)
    naming the file on a full disk; the caller renames the finished file into place (nothing here
    is atomic by itself). `sync` fsyncs before close: for files whose presence marks something
    complete; an export's manifest catches a file lost in a crash."""

    def __init__(self, path: Path, entries: list[Entry], metadata: dict[str, str] | None = None, sync: bool = True,
                 depth: int = 2):
        import queue
        import threading

        self.path = Path(path)
        self.sync = sync
        self.entries = list(entries)
        self.digest = hashlib.sha256()
        self.next = 0
        self.error: BaseException | None = None
        self.fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        # Two threads: one writes, one hashes the same bytes (each releases the GIL and they do
        # not wait for each other); each item is let go when both are done with it.
        self.queues = (queue.Queue(maxsize=depth), queue.Queue(maxsize=depth))
        self.threads = [threading.Thread(target=self._drain, args=(q, work), name=f"{name} {self.path.name}", daemon=True)
                        for q, work, name in zip(self.queues, (self._write_bytes, self.digest.update), ("write", "hash"))]
        for thread in self.threads:
            thread.start()
        self._put(layout(self.entries, metadata, self.path.name).header)

    def _write_bytes(self, data) -> None:
        pwrite_all(self.fd, memoryview(data), None, self.path)

    def _drain(self, pending, work) -> None:
        while (item := pending.get()) is not None:
            if self.error is not None:
                continue  # keep taking items so the producer never blocks; report at close
            try:
                work(item[0] if isinstance(item, tuple) else item)
            except BaseException as err:  # noqa: BLE001 - re-raised in the caller's thread
                self.error = err

    def _put(self, data) -> None:
        if self.error is not None:
            raise self.error
        for pending in self.queues:
            pending.put(data)

    def write(self, tensor) -> None:
        entry = self.entries[self.next]
        if tuple(tensor.shape) != entry.shape or str(tensor.dtype).removeprefix("torch.") != entry.dtype:
            raise ValueError(f"{entry.name}: got {tensor.dtype} {tuple(tensor.shape)}, declared {entry.dtype} {entry.shape}")
        data = tensor_bytes(tensor)
        self._put((data, tensor))  # the tensor rides along: its memory lives until written
        self.next += 1

    def _finish(self) -> None:
        for pending, thread in zip(self.queues, self.threads):
            if thread.is_alive():
                pending.put(None)
                thread.join()

    def close(self) -> str:
        self._finish()
        try:
            if self.error is not None:
                raise self.error
            if self.next != len(self.entries):
                raise ValueError(f"{self.path.name}: {len(self.entries) - self.next} declared tensors were never written")
            if self.sync:
                try:
                    os.fsync(self.fd)
                except OSError as err:
                    if err.errno == errno.ENOSPC:
                        raise OSError(errno.ENOSPC, "No space left on device", str(self.path)) from err
                    raise
        finally:
            os.close(self.fd)
            self.fd = -1
        return self.digest.hexdigest()

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is not None and self.fd >= 0:
            self._finish()
            os.close(self.fd)
            self.fd = -1


class SafetensorsReader:
    """One tensor at a time, read with pread into memory of its own: no mmap, so a reader holds
    the tensors it returned and nothing of the file (an mmap's pages would stay mapped, and count,
    for as long as the file is open). Validate the file with safetensors' parser first
    (pipeline.checkpoint.hf_dir.read_header): this only reads what that parser accepted."""

    def __init__(self, path: Path):
        from pipeline.fsutil import regular_file

        self.path = Path(path)
        regular_file(self.path, "restore the checkpoint's weights (a FIFO or device there is never read).")
        self.fd = os.open(self.path, os.O_RDONLY)
        size = int.from_bytes(os.pread(self.fd, 8, 0), "little")
        header = json.loads(os.pread(self.fd, size, 8))
        header.pop("__metadata__", None)
        self.base, self.header = 8 + size, header

    def keys(self) -> list[str]:
        return list(self.header)

    def get(self, name: str):
        import torch

        info = self.header[name]
        dtype = getattr(torch, SAFETENSORS_NAMES[info["dtype"]])
        out = torch.empty(info["shape"], dtype=dtype)
        view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
        begin, end = info["data_offsets"]
        if len(view) != end - begin:
            raise ValueError(f"{self.path}: {name} has {end - begin} bytes for shape {info['shape']} {info['dtype']}")
        offset = self.base + begin
        while len(view):
            read = os.preadv(self.fd, [view], offset)
            if read == 0:
                raise ValueError(f"{self.path} ends inside {name}")
            view, offset = view[read:], offset + read
        return out

    def view(self, name: str):
        """The tensor as a read-only view of the file's pages (no copy): for reading once, e.g. to
        compare; the pages stay mapped while the view lives."""
        import numpy as np
        import torch

        if getattr(self, "_map", None) is None:
            self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        info = self.header[name]
        begin, end = info["data_offsets"]
        raw = torch.from_numpy(self._map[self.base + begin:self.base + end])
        return raw.view(getattr(torch, SAFETENSORS_NAMES[info["dtype"]])).reshape(info["shape"])

    def close(self) -> None:
        self._map = None
        os.close(self.fd)

    def __enter__(self) -> "SafetensorsReader":
        return self

    def __exit__(self, *_) -> None:
        self.close()


def _uint8():
    import torch

    return torch.uint8


def pwrite_all(fd: int, data: memoryview, offset: int | None, path: Path) -> None:
    """Every byte of `data` at `offset` (os.pwrite: several writers may share one file), or at the
    file's position when `offset` is None."""
    data = data.cast("B")
    while len(data):
        try:
            written = os.write(fd, data) if offset is None else os.pwrite(fd, data, offset)
        except OSError as err:
            if err.errno == errno.ENOSPC:
                raise OSError(errno.ENOSPC, "No space left on device", str(path)) from err
            raise
        data = data[written:]
        offset = None if offset is None else offset + written


def finite(tensor) -> bool:
    """No NaN or Inf: a NaN or an infinity makes any sum of it non-finite (IEEE), and a sum of finite
    values is finite unless it overflows, so one reduction decides and only an overflowing sum pays for
    the exact element-wise check, whatever the sum's precision. The sum is in the tensor's own dtype
    (torch's bfloat16 sum is vectorized: 1.1 GiB in 0.05 s on 2 cores, where sum(dtype=float32) took
    0.3 s); float16 alone is summed in float32, as its range would make the slow path common."""
    import torch

    total = tensor.sum(dtype=torch.float32) if tensor.dtype == torch.float16 else tensor.sum()
    return bool(torch.isfinite(total)) or bool(torch.isfinite(tensor).all())
