"""manifest.json: the sha256 and size of every file of an export, written last, checked by verify."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text, read_json_object, regular_file

MANIFEST = "manifest.json"


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    regular_file(path, "re-run `make export … FORCE=1`: an export holds regular files only.")
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write(directory: Path, info: dict, known: dict[str, str] | None = None) -> None:
    """`known`: sha256 already computed while a file was written (export's shards), not re-read."""
    known = known or {}
    files = {p.name: {"sha256": known.get(p.name) or sha256(p), "bytes": p.stat().st_size}
             for p in sorted(Path(directory).iterdir()) if p.is_file() and p.name != MANIFEST}
    atomic_write_text(Path(directory) / MANIFEST, json.dumps({**info, "files": files}, indent=2) + "\n")


def read(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise PipelineError(f"{directory} has no {MANIFEST}: not a complete export.", "re-run `make export … FORCE=1`.")
    return read_json_object(path, "re-run `make export … FORCE=1`.")


def check(directory: Path) -> dict:
    """Re-hash every file listed in manifest.json; raise on any difference."""
    manifest = read(directory)
    for name, entry in manifest["files"].items():
        file = Path(directory) / name
        if not file.exists():
            raise PipelineError(f"{file} is listed in {MANIFEST} but missing.", "re-run `make export … FORCE=1`.")
        if file.stat().st_size != entry["bytes"] or sha256(file) != entry["sha256"]:
            raise PipelineError(f"{file} differs from its sha256 in {MANIFEST}.", "re-run `make export … FORCE=1`.")
    return manifest
