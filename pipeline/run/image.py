"""The pipeline image's name: qwen3-pipeline:lock-<sha256 of requirements.lock, 12 hex>, so a
changed lock is a new image and one tag means one set of packages."""

from __future__ import annotations

import hashlib
from pathlib import Path

from pipeline.errors import PipelineError

IMAGE_REPO = "qwen3-pipeline"
LOCK = Path(__file__).resolve().parent.parent.parent / "requirements.lock"


def lock_sha256(lock: Path) -> str:
    try:
        return hashlib.sha256(Path(lock).read_bytes()).hexdigest()
    except FileNotFoundError as err:
        raise PipelineError(f"lock file {lock} does not exist.", "pass --lock with an existing file.") from err


def default_tag(lock: Path | None = None) -> str:
    return f"{IMAGE_REPO}:lock-{lock_sha256(lock or LOCK)[:12]}"
