"""Stage `data`: the training text in the form torchtitan's HF text loader reads.

Embedded defaults: the corpus's held-out documents (never seen in pretraining) as JSON
lines with a "text" field, which `datasets.load_dataset("json")` feeds to torchtitan's
HuggingFaceTextDataset, at checkpoints/<key>/data/train.jsonl. Other models read the dataset
their config names (C4 on trn2) or DATASET=, so nothing is written for them.

A Hub dataset for fine-tuning (DATASET=org/name with DATASET_SPLIT and/or DATASET_COLUMNS) is
copied once: `datasets.load_dataset(id, split=…)`, columns renamed to the pipeline's (messages,
prompt/completion or text; e.g. messages=conversations), every record checked, written to
data/hub/<org>--<name>.jsonl with a record of where it came from. Training with DATASET=org/name
then reads that copy, chat or text as its keys say (pipeline.training.dataset).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline.checkpoint import corpus
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.run import store
from pipeline.training.dataset import CHAT_EVAL_FILE, CHAT_FILE, HUB_ID, hub_copy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", help="a Hub dataset id (or a local dataset directory) to copy for fine-tuning")
    parser.add_argument("--split", help="its split to copy (default: train)")
    parser.add_argument("--eval-split", help="a held-out split copied beside it for eval loss (e.g. test)")
    parser.add_argument("--columns", default="", help="our name=their column, comma-separated, e.g. "
                                                      "messages=conversations or prompt=question,completion=answer")


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


OUR_COLUMNS = ("messages", "prompt", "completion", "text")


def parse_columns(given: str) -> dict[str, str]:
    """"messages=conversations,…" → {"messages": "conversations", …}, refused in one line when malformed."""
    mapping = {}
    for item in filter(None, (part.strip() for part in given.split(","))):
        ours, _, theirs = item.partition("=")
        if ours.strip() not in OUR_COLUMNS or not theirs.strip():
            raise PipelineError(f"DATASET_COLUMNS item {item!r} is not <ours>=<their column> with ours one of "
                                f"{', '.join(OUR_COLUMNS)}.", "e.g. DATASET_COLUMNS=messages=conversations.")
        mapping[ours.strip()] = theirs.strip()
    return mapping


def copy_hub_dataset(dataset: str, split: str, columns: dict[str, str], out: Path) -> tuple[int, str]:
    """The split as JSON lines of the pipeline's columns, each record checked; returns (records, format)."""
    from datasets import load_dataset
    from tqdm import tqdm

    from pipeline.training.dataset import check_record

    try:
        rows = load_dataset(dataset, split=split)
    except Exception as err:  # offline, unknown id or split, gated: datasets raises many kinds
        raise PipelineError(f"DATASET={dataset} split {split!r} cannot be loaded: {type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}",
                            "check the id, DATASET_SPLIT and the network (HF_TOKEN for gated sets).") from err
    missing = sorted(set(columns.values()) - set(rows.column_names))
    if missing:
        raise PipelineError(f"DATASET={dataset} split {split!r} has no column {', '.join(missing)} "
                            f"(it has {', '.join(rows.column_names)}).", "fix DATASET_COLUMNS.")
    renamed = {theirs: ours for ours, theirs in columns.items()}
    keep = [c for c in rows.column_names if renamed.get(c, c) in OUR_COLUMNS]
    form, lines = None, []
    for number, row in enumerate(tqdm(rows, desc=f"copying {dataset}:{split}", unit="rec",
                                      disable=len(rows) < 10_000), 1):
        line = json.dumps({renamed.get(c, c): row[c] for c in keep}, ensure_ascii=False)
        form = check_record(line, f"DATASET={dataset} split {split!r}", number, form)
        lines.append(line + "\n")
    if not lines:
        raise PipelineError(f"DATASET={dataset} split {split!r} is empty.", "choose another DATASET_SPLIT.")
    atomic_write_text(out, "".join(lines))
    return len(lines), form


def run(args: argparse.Namespace) -> Path | None:
    home = store.home(args.model)
    store.mark_root(home.root)
    if args.split or args.columns or args.eval_split:
        if not args.dataset or not HUB_ID.fullmatch(args.dataset) and not Path(args.dataset).is_dir():
            raise PipelineError("DATASET_SPLIT and DATASET_COLUMNS choose what to copy of a Hub dataset; "
                                f"DATASET={args.dataset or '(unset)'} is not one.",
                                "give DATASET=<org/name> (or a local dataset directory), or drop them.")
        out = hub_copy(home.data_file.parent, args.dataset)
        split = args.split or "train"
        count, form = copy_hub_dataset(args.dataset, split, parse_columns(args.columns), out)
        atomic_write_text(out.with_suffix(".json"), json.dumps({"dataset": args.dataset, "split": split,
                                                                "columns": parse_columns(args.columns),
                                                                "records": count, "format": form}, indent=2) + "\n")
        print(f"DATASET={args.dataset} split {split!r}: {count} {form} records → {out}; runs with "
              f"DATASET={args.dataset} read it")
        if not args.eval_split:
            out.with_suffix(".eval.jsonl").unlink(missing_ok=True)  # an earlier copy's eval split is not this one's
        else:
            if args.eval_split == split:
                raise PipelineError(f"DATASET_EVAL_SPLIT={split} is the training split: its loss says nothing "
                                    "about held-out data.", "give the dataset's held-out split (e.g. test).")
            held = out.with_suffix(".eval.jsonl")
            count, held_form = copy_hub_dataset(args.dataset, args.eval_split, parse_columns(args.columns), held)
            if held_form != form:
                held.unlink()
                raise PipelineError(f"split {args.eval_split!r} is {held_form} data and {split!r} is {form}.",
                                    "give a held-out split of the same kind.")
            print(f"held out for eval: split {args.eval_split!r}, {count} records → {held}")
    written = write_local_data(home.data_file)
    print(f"training data: {written} ({len(corpus.held_out_documents())} held-out documents, "
          f"corpus sha256 {corpus.checked_fingerprint()[:12]})")
    chat, held, n_train, n_held = write_chat_data(home.data_file)
    print(f"chat data (DATASET=chat): {chat} ({n_train} conversations), held out for eval: {held} ({n_held})")
    return written
