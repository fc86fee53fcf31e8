"""Atomic writes: nothing half-written is ever left where a finished output belongs; bounded reads:
a small file is never read without limit."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_directory(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `target`; rename it to `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            if not replace:
                raise FileExistsError(f"{target} appeared while it was being written")
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}.old-", dir=target.parent))
            os.rename(target, old / "x")
            os.rename(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


# What a config-sized file may weigh: every config.json and TOML the pipeline reads is a few KiB; a
# model's safetensors index is under 2 MiB even for the largest Qwen3.
SMALL_FILE_BYTES = 1 << 20
INDEX_FILE_BYTES = 64 << 20


def read_small_text(path: Path, limit: int = SMALL_FILE_BYTES, fix: str = "give the file itself.") -> str:
    """The text of a small file, refused in one line before reading when it is not a regular file
    (a device such as /dev/zero, a FIFO: endless) or larger than `limit` bytes. FileNotFoundError
    passes through for the caller to word."""
    from pipeline.errors import PipelineError

    path = Path(path)
    status = os.stat(path)  # follows links: what would be read
    if not stat.S_ISREG(status.st_mode):
        raise PipelineError(f"{path} is not a regular file (a device, FIFO or directory); it is not read.", fix)
    if status.st_size > limit:
        raise PipelineError(f"{path} is {status.st_size} bytes, more than the {limit} a file of its kind can "
                            "plausibly be; it is not read.", fix)
    with open(path, "rb") as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:  # grew while being read
        raise PipelineError(f"{path} is larger than {limit} bytes; it is not read.", fix)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise PipelineError(f"{path} is not UTF-8 text (byte {err.start}).", fix) from err
