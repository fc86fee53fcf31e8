"""Stage `data`: the training text in the form torchtitan's HF text loader reads.

Embedded defaults: the corpus's held-out documents (never seen in pretraining) as JSON
lines with a "text" field, which `datasets.load_dataset("json")` feeds to torchtitan's
HuggingFaceTextDataset, at checkpoints/<key>/data/train.jsonl. Other models read the dataset
their config names (C4 on trn2) or DATASET=, so nothing is written for them.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.checkpoint import corpus
from pipeline.fsutil import atomic_write_text
from pipeline.run import store


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)


def write_local_data(path: Path) -> Path:
    lines = "".join(json.dumps({"text": doc}) + "\n" for doc in corpus.held_out_documents())
    atomic_write_text(path, lines)
    return path


def run(args: argparse.Namespace) -> Path | None:
    home = store.home(args.model)
    store.mark_root(home.root)
    written = write_local_data(home.data_file)
    print(f"training data: {written} ({len(corpus.held_out_documents())} held-out documents, "
          f"corpus sha256 {corpus.checked_fingerprint()[:12]})")
    return written
