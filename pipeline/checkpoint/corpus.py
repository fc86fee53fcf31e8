"""The embedded default's English corpus: the docstrings of a pinned transformers release.

Pinned inputs only, so `tiny` is the same model on every machine: transformers==5.16.0 is pinned
by both locks (dev and image) and its source files are the same wheel everywhere. (CPython's
`pydoc_data`, used before, differs between patch releases.) Documents are the long docstrings
of transformers' top-level and generation modules (~840k characters of technical prose, each distinct), read
with `ast` (nothing is imported), in file and line order; every tenth is held out for the
training stage, the rest pretrain the tiny checkpoints.
"""

from __future__ import annotations

import ast
import hashlib
from functools import cache
from importlib import metadata, util
from pathlib import Path

from pipeline.errors import PipelineError

TRANSFORMERS_VERSION = "5.16.0"
# sha256 of documents() from transformers 5.16.0; a mismatch means another corpus, another tiny.
SHA256 = "2377fbc81518fbb17c67bfe0027193a634f84c10b8118dde4a0b269258859963"
HELD_OUT_EVERY = 10
MIN_CHARS = 300


def transformers_dir() -> Path:
    spec = util.find_spec("transformers")
    if spec is None or spec.origin is None:
        raise PipelineError("transformers is not installed.", "run `make setup`.")
    version = metadata.version("transformers")
    if version != TRANSFORMERS_VERSION:
        raise PipelineError(f"the embedded corpus is read from transformers {TRANSFORMERS_VERSION}, this environment "
                            f"has {version}: the embedded models would differ from everyone else's.",
                            "install the locks' transformers (`make setup`).")
    return Path(spec.origin).parent


@cache
def documents() -> tuple[str, ...]:
    root = transformers_dir()
    docs, seen = [], set()
    for file in sorted(root.glob("*.py")) + sorted(root.glob("generation/*.py")):
        tree = ast.parse(file.read_text(encoding="utf-8"))
        nodes = [n for n in ast.walk(tree) if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))]
        for node in sorted(nodes, key=lambda n: getattr(n, "lineno", 0)):
            text = ast.get_docstring(node)
            # transformers repeats some docstrings; a repeat would put held-out text into pretraining.
            if text and len(text) >= MIN_CHARS and text not in seen:
                seen.add(text)
                docs.append(text)
    return tuple(docs)


def pretraining_documents() -> list[str]:
    return [d for i, d in enumerate(documents()) if i % HELD_OUT_EVERY != 0]


def held_out_documents() -> list[str]:
    return [d for i, d in enumerate(documents()) if i % HELD_OUT_EVERY == 0]


def fingerprint() -> str:
    """sha256 of the whole corpus, recorded in every embedded checkpoint."""
    digest = hashlib.sha256()
    for doc in documents():
        digest.update(doc.encode())
        digest.update(b"\0")
    return digest.hexdigest()


def checked_fingerprint() -> str:
    """The fingerprint, refused unless it is the pinned one (the same tiny models everywhere)."""
    found = fingerprint()
    if found != SHA256:
        raise PipelineError(f"the embedded corpus has sha256 {found[:12]}…, not the pinned {SHA256[:12]}…: "
                            f"transformers {TRANSFORMERS_VERSION}'s sources differ here.",
                            "reinstall the locks' transformers (`rm -r .venv && make setup`).")
    return found
