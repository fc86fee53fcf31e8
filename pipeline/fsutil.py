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


def ordinary_mode(mode: int) -> int:
    """`mode` less the process's umask: what mkdir or open would have given the file."""
    with contextlib.suppress(OSError, StopIteration, ValueError):  # Linux says it without changing it
        status = Path("/proc/self/status").read_text().splitlines()
        return mode & ~int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: read by setting, at once set back (briefly process-wide)
    os.umask(mask)
    return mode & ~mask


def give_ordinary_modes(*paths: Path) -> None:
    """Each file the mode open() would have given it (0644 under umask 022): safetensors' save_file (and so
    save_pretrained, PEFT's too) creates its files 0600 (safetensors 0.8), which others cannot read."""
    mode = ordinary_mode(0o666)
    for path in paths:
        os.chmod(path, mode)


@contextlib.contextmanager
def atomic_directory(target: Path, replace: bool = False) -> Iterator[Path]:
    """Yield a temporary sibling of `target`; rename it to `target` only if the block succeeds."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        os.chmod(tmp, ordinary_mode(0o777))  # mkdtemp's 0700 would make an export others cannot read
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
        os.chmod(tmp, ordinary_mode(0o666))  # mkstemp's 0600 is not what open() would have given
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def fsync_file(path: Path) -> None:
    """Flush a file (or a directory's entries) that another writer left in the page cache to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# What a config-sized file may weigh: every config.json and TOML the pipeline reads is a few KiB; a
# model's safetensors index is under 2 MiB even for the largest Qwen3.
SMALL_FILE_BYTES = 1 << 20
INDEX_FILE_BYTES = 64 << 20


def regular_file(path: Path, fix: str = "give the file itself.") -> os.stat_result:
    """The status of `path`, refused in one line when it is not a regular file: opening a FIFO blocks until
    a writer comes (a stage holding a run's lock would hang), a device reads without end. Every file a stage
    reads goes through this first. FileNotFoundError passes through for the caller to word."""
    from pipeline.errors import PipelineError

    status = os.stat(path)  # follows links: what would be read
    if not stat.S_ISREG(status.st_mode):
        raise PipelineError(f"{path} is not a regular file (a device, FIFO or directory); it is not read.", fix)
    return status


def read_small_text(path: Path, limit: int = SMALL_FILE_BYTES, fix: str = "give the file itself.") -> str:
    """The text of a small file, refused in one line before reading when it is not a regular file
    (a device such as /dev/zero, a FIFO: endless) or larger than `limit` bytes. FileNotFoundError
    passes through for the caller to word."""
    from pipeline.errors import PipelineError

    path = Path(path)
    status = regular_file(path, fix)
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


def read_json_object(path: Path, fix: str, limit: int = SMALL_FILE_BYTES) -> dict:
    """A small JSON file holding an object (a record the pipeline wrote: run.json, manifest.json, …), refused
    in one line when it is not a regular file, torn (a kill mid-write, an edit) or another JSON value."""
    import json

    from pipeline.errors import PipelineError

    text = read_small_text(path, limit, fix)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PipelineError(f"{path} is not valid JSON ({err.msg}: line {err.lineno} column {err.colno}); "
                            "torn or edited.", fix) from err
    if not isinstance(data, dict):
        raise PipelineError(f"{path} holds a JSON {type(data).__name__}, not the object the pipeline writes.", fix)
    return data
