"""Stages `clean` and `distclean` (--all): delete what the pipeline wrote in its checkpoints root, and nothing else.

Only in a root carrying the pipeline's marker (a regular file; pipeline.run.store.mark_root writes it into a
root only the pipeline made), and only in the model folders the pipeline made there (the marker lists them):
clean deletes their runs, data, reports, launch files and rehearsals (downloads stay), and the data sets the
stages share under the root (data/sets, data/carried); distclean also the folders and the pushed-image record.
Whatever else the root holds is left, and named. Standard library only: it runs before `make setup` too.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.launch import pushed
from pipeline.run import store

# What clean deletes in a model folder: what the stages make from the download (ModelHome's folders).
DERIVED = ("runs", "data", "report", "launch", "rehearse")
# The data the stages share under the root: staged C4 shards and splits of a user's files (pipeline.data.staged's
# SETS), and the files launch carried to a cluster (launch.cluster); spelled here: this stage is standard library only.
SHARED_DATA = Path("data")
SHARED_SETS = (SHARED_DATA / "sets", SHARED_DATA / "carried")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--all", action="store_true", help="distclean: the model folders themselves (downloads too)")


def remove(path: Path) -> bool:
    """Delete a file or folder; a link is removed, never followed."""
    if path.is_symlink() or path.is_file():
        path.unlink()
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        return False
    return True


def run(args: argparse.Namespace) -> list[Path]:
    root = store.checkpoints_root()
    if not root.is_dir():
        print(f"{root} does not exist; nothing to delete.")
        return []
    if not store.is_marked(root):
        raise PipelineError(f"{root} carries no {store.ROOT_MARKER} (a regular file the pipeline writes into a "
                            "checkpoints root it made), so it is not a checkpoints root the pipeline made; nothing "
                            "deleted.", "point PIPELINE_CHECKPOINTS at the pipeline's checkpoints root (or create "
                            f"{root}/{store.ROOT_MARKER} if it is one).")
    keys = store.pipeline_keys(root)
    targets = [root / key for key in keys] + [pushed.record_path(root)] if args.all else \
        [root / key / part for key in keys for part in DERIVED]
    deleted = [path for path in [*targets, *(root / sets for sets in SHARED_SETS)] if remove(path)]
    if (root / SHARED_DATA).is_dir() and not any((root / SHARED_DATA).iterdir()):
        (root / SHARED_DATA).rmdir()  # data/ held only the shared sets
    if args.all:
        atomic_write_text(root / store.ROOT_MARKER, store.MARKER_HEADER)  # still the pipeline's root, no folder now
    print(f"deleted {len(deleted)} entries of {len(keys)} model folder(s) the pipeline made in {root}: "
          + (", ".join(str(p.relative_to(root)) for p in deleted) or "none"))
    others = sorted(p.name for p in root.iterdir() if p.name not in (*keys, store.ROOT_MARKER, "README.md", pushed.RECORD))
    if others:
        print(f"left what the pipeline did not write there: {', '.join(others)}")
    return deleted
