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
from pipeline.training.dataset import CHAT_EVAL_FILE, CHAT_FILE


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)


# The chat set made from the same held-out documents (DATASET=chat): conversations short enough for
# the embedded configs' seq_len 128 with the chat template's markup (about 30 tokens).
CHAT_SYSTEM = "You continue documentation of the transformers library."
CHAT_WORDS = (8, 14, 10)  # the user's opening, the first answer, the answer after "Go on."
CHAT_EVAL_EVERY = 8  # every 8th conversation is held out for eval loss (never trained on)


def write_local_data(path: Path) -> Path:
    lines = "".join(json.dumps({"text": doc}) + "\n" for doc in corpus.held_out_documents())
    atomic_write_text(path, lines)
    return path


def conversations(documents: list[str]) -> list[dict]:
    """Two-turn conversations (system, user, assistant, user, assistant) cut from each document's
    words in order: the assistant continues what the user quoted, then goes on."""
    out = []
    size = sum(CHAT_WORDS)
    for doc in documents:
        words = doc.split()
        for at in range(0, len(words) - size + 1, size):
            opening, first, second = (" ".join(words[at + sum(CHAT_WORDS[:i]):at + sum(CHAT_WORDS[:i + 1])])
                                      for i in range(3))
            out.append({"messages": [{"role": "system", "content": CHAT_SYSTEM},
                                     {"role": "user", "content": f"Continue: {opening}"},
                                     {"role": "assistant", "content": first},
                                     {"role": "user", "content": "Go on."},
                                     {"role": "assistant", "content": second}]})
    return out


def write_chat_data(train_file: Path) -> tuple[Path, Path, int, int]:
    """data/chat.jsonl and data/chat_eval.jsonl: a deterministic split, every CHAT_EVAL_EVERY-th
    conversation held out."""
    records = conversations(corpus.held_out_documents())
    train = [r for i, r in enumerate(records) if i % CHAT_EVAL_EVERY != CHAT_EVAL_EVERY - 1]
    held = [r for i, r in enumerate(records) if i % CHAT_EVAL_EVERY == CHAT_EVAL_EVERY - 1]
    paths = train_file.with_name(CHAT_FILE), train_file.with_name(CHAT_EVAL_FILE)
    for path, rows in zip(paths, (train, held)):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return *paths, len(train), len(held)


def run(args: argparse.Namespace) -> Path | None:
    home = store.home(args.model)
    store.mark_root(home.root)
    written = write_local_data(home.data_file)
    print(f"training data: {written} ({len(corpus.held_out_documents())} held-out documents, "
          f"corpus sha256 {corpus.checked_fingerprint()[:12]})")
    chat, held, n_train, n_held = write_chat_data(home.data_file)
    print(f"chat data (DATASET=chat): {chat} ({n_train} conversations), held out for eval: {held} ({n_held})")
    return written
