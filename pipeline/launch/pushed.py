"""What `make push` pushed: local image tag → the registry reference pinned by its digest.

Cluster launch files name an image by digest (registry/repo@sha256:…), the one a node pulls whatever
a tag points at later; this record lets `make launch-*` find it for the image `make image` built.
The record lives in the checkpoints root (images.json), beside the runs that use it.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from pipeline.fsutil import atomic_write_text, read_json_object
from pipeline.run import store

RECORD = "images.json"
PINNED = re.compile(r"^[^@\s]+/[^@\s]+@sha256:[0-9a-f]{64}$")  # a registry path and a digest


def record_path(root: Path | None = None) -> Path:
    return (root or store.checkpoints_root()) / RECORD


def is_pinned(reference: str) -> bool:
    return bool(PINNED.match(reference))


def records(root: Path | None = None) -> dict:
    path = record_path(root)
    return read_json_object(path, f"delete {path} and run `make push` again.") if path.exists() else {}


def reference(local_tag: str, root: Path | None = None) -> str | None:
    entry = records(root).get(local_tag)
    return entry["reference"] if entry else None


def record(local_tag: str, pinned_reference: str, pushed_tag: str, root: Path | None = None) -> Path:
    data = records(root)
    data[local_tag] = {"reference": pinned_reference, "tag": pushed_tag}
    path = record_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")
    return path
