"""Stage `download`: the checkpoint a model's runs start from, validated, recorded in source.json.

MODEL is one of: an embedded default (`tiny`, `tiny-moe`: made here, offline, into
checkpoints/<key>/source/), a local directory (validated, then copied there), or a Hub id
(snapshot_download of the safetensors, JSON and tokenizer files at a pinned revision into the
Hugging Face cache, where other HF tools share it; resumable; HF_TOKEN read from the environment
and never printed). source.json is written last: a model is downloaded exactly when it exists.
"""

from __future__ import annotations

import argparse
import contextlib
from pathlib import Path

from pipeline import flags
from pipeline.checkpoint import hf_dir
from pipeline.launch import sources
from pipeline.run import store
from pipeline.run.ref import RunRef


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, only=("model",))
    parser.add_argument("--revision", help="Hub revision (default: the pin in configs/models.toml)")
    parser.add_argument("--force", action="store_true", help="replace an existing download")


def run(args: argparse.Namespace) -> Path:
    home = store.home(args.model)
    revision = sources.revision(home.source, args.revision)
    record = home.record()
    if record is not None and not args.force and (revision is None or revision in (record.get("revision"),
                                                                                   record.get("commit"))):
        directory = home.source_dir()
        hf_dir.validate(directory)
        if home.source.kind == "hub":
            sources.link_hub_source(home)  # a download made before the link existed gets it too
        print(f"{args.model} is already downloaded and valid ({directory}); nothing to do (FORCE=1 to replace).")
        return directory
    kind = home.source.kind
    if kind == "config":
        raise store.config_only(home.source)
    if kind == "local":
        hf_dir.validate(Path(home.source.path))  # a broken source leaves nothing behind
    # Fail on an unwritable checkpoints root now, not after minutes of work.
    store.mark_root(home.root)  # its key is recorded with source.json
    created = not home.dir.exists()
    home.dir.mkdir(parents=True, exist_ok=True)
    try:
        return sources.fetch(args.model, home, revision)
    except BaseException:
        if created:  # a refused MODEL (a bad Hub id) leaves no empty checkpoints/<key>/ behind
            with contextlib.suppress(OSError):
                home.dir.rmdir()  # only when empty
        raise


