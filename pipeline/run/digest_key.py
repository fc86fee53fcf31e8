"""The per-user key that makes a run's DCP digests unforgeable from inside the checkpoints root.

dcp_digests.json sits in the run directory beside the `.metadata` it guards, so a plain sha256 there
guards nothing against whoever can write that directory: they plant a pickle and rewrite its digest.
The digests are therefore HMAC-SHA256 under a key only this user can read, kept outside the
checkpoints root: $PIPELINE_DIGEST_KEY, else $XDG_CONFIG_HOME/qwen3-pipeline/dcp-digest.key (~/.config
without XDG_CONFIG_HOME). It is made on the first save (32 random bytes, hex, mode 0600 in a 0700
folder, linked into place so that two processes making it at once agree on one) and refused when
others may read or write it, or when it lies under the checkpoints root. Every rank of a run checks
the digest before a resume, so every node must read the same key: a home directory shared by the
nodes gives it (Slurm clusters usually share /home), or PIPELINE_DIGEST_KEY names a 0600 file on
the shared filesystem outside the checkpoints root (on EKS, a Secret mounted as a file).
"""

from __future__ import annotations

import contextlib
import hmac
import os
import secrets
import stat
import tempfile
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError

KEY_FILE = "dcp-digest.key"
PROJECT = "qwen3-pipeline"
KEY_BYTES = 32


def key_path() -> Path:
    given = os.environ.get(envvars.DIGEST_KEY)
    if given:
        return Path(given).expanduser()
    config = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(config) / PROJECT / KEY_FILE


def digest(data: bytes, label: str, guarded: Path, create: bool = False) -> str:
    """HMAC-SHA256 of `label` (what the bytes are, e.g. the step) and `data` under the user's key, which
    must lie outside `guarded` (the checkpoints root of what the digest guards)."""
    return hmac.new(load(guarded, create), label.encode() + b"\0" + data, "sha256").hexdigest()


def same(a: str, b: str) -> bool:
    return hmac.compare_digest(a.encode(), b.encode())


def load(guarded: Path, create: bool = False) -> bytes:
    """The key's bytes; made first when `create` and there is none."""
    path = key_path()
    _outside(path, Path(guarded))
    if create and not path.exists():
        _create(path)
    fix = (f"remove {path} (a new key is made at the next save; resuming the runs saved under the old one then "
           f"needs FRESH=1), or set {envvars.DIGEST_KEY} to your own key file.")
    try:
        status = os.stat(path)
    except FileNotFoundError:
        raise PipelineError(f"the key the DCP digests are made with, {path}, does not exist on this machine, so no "
                            "recorded digest can be checked.",
                            f"run where the key of the save is (every node of a run needs the same one: set "
                            f"{envvars.DIGEST_KEY} to a 0600 file on the shared filesystem), or start over with "
                            "FRESH=1.") from None
    if not stat.S_ISREG(status.st_mode) or status.st_uid != os.geteuid() or status.st_mode & 0o077:
        raise PipelineError(f"{path} (the key of the DCP digests) is not a regular file of yours that only you can "
                            f"read and write (mode {stat.filemode(status.st_mode)}, owner uid {status.st_uid}): "
                            "whoever else reads it can forge a digest.", f"chmod 600 {path} if it is yours; else {fix}")
    with open(path, "rb") as handle:
        text = handle.read(4 * KEY_BYTES).strip()
    try:
        key = bytes.fromhex(text.decode("ascii"))
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise PipelineError(f"{path} is not a DCP digest key ({2 * KEY_BYTES} hex digits).", fix)
    return key


def _outside(path: Path, guarded: Path) -> None:
    root = guarded.resolve()
    where = path.resolve()
    if where == root or root in where.parents:
        raise PipelineError(f"the DCP digest key {path} lies under the checkpoints root {root}, beside what it "
                            "guards: whoever can write a run there could rewrite it too.",
                            f"set {envvars.DIGEST_KEY} to a file outside {root} (or unset it: "
                            "$XDG_CONFIG_HOME/qwen3-pipeline/ is the default).")


def _create(path: Path) -> None:
    """Written whole to a temporary 0600 file, then linked into place: never a half-written key, and of
    two makers at once the second takes the first's key."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)  # mkstemp: 0600
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(KEY_BYTES) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        with contextlib.suppress(FileExistsError):
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
