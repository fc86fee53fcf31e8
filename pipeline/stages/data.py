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
from pipeline.training.data_files import copy_hub_dataset, parse_columns, write_embedded_data
from pipeline.training.dataset import HUB_ID, hub_copy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--dataset", help="a Hub dataset id (or a local dataset directory) to copy for fine-tuning")
    parser.add_argument("--split", help="its split to copy (default: train)")
    parser.add_argument("--eval-split", help="a held-out split copied beside it for eval loss (e.g. test)")
    parser.add_argument("--columns", default="", help="our name=their column, comma-separated, e.g. "
                                                      "messages=conversations or prompt=question,completion=answer")


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
    made = write_embedded_data(home.data_file)
    state = " (up to date)" if made.reused else ""
    print(f"training data{state}: {made.train} ({made.counts['documents']} held-out documents, "
          f"corpus sha256 {corpus.SHA256[:12]})")
    print(f"chat data (DATASET=chat){state}: {made.chat} ({made.counts['conversations']} conversations), "
          f"held out for eval: {made.chat_eval} ({made.counts['held_out']})")
    return made.train
