"""Where each stage reads and writes: checkpoints/<name>/{hf,data,<path>,…}."""

from __future__ import annotations

import os
from pathlib import Path

from pipeline.embedded import EMBEDDED
from pipeline.errors import PipelineError

REPO = Path(__file__).resolve().parent.parent


def checkpoints_root() -> Path:
    return Path(os.environ.get("PIPELINE_CHECKPOINTS", REPO / "checkpoints"))


def model_name(model: str) -> str:
    """MODEL as given to download (Hub id, directory, embedded name) → its <name>."""
    name = Path(model.rstrip("/")).name
    if not name or name in (".", ".."):
        raise PipelineError(f"MODEL={model!r} has no usable name.", "give a Hub id, a directory or tiny/tiny-moe.")
    return name


def model_dir(model: str) -> Path:
    return checkpoints_root() / model_name(model)


def hf_dir(model: str) -> Path:
    return model_dir(model) / "hf"


# <name>/hf is the downloaded checkpoint, so the hf training path's run cannot be named after
# its path (a --fresh run would delete the checkpoint it is about to load).
RUN_DIR_NAMES = {"hf": "hf-run"}


def run_dir(model: str, path: str) -> Path:
    return model_dir(model) / RUN_DIR_NAMES.get(path, path)


def data_file(model: str) -> Path:
    return model_dir(model) / "data" / "train.jsonl"


def downloaded_hf_dir(model: str) -> Path:
    directory = hf_dir(model)
    if not (directory / "config.json").exists():
        hint = f"make download MODEL={model}"
        raise PipelineError(f"{directory} does not exist: {model!r} has not been downloaded.", f"run `{hint}` first.")
    return directory


def is_embedded(model: str) -> bool:
    return model in EMBEDDED
