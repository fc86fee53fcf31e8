"""Stage `data`: the training text in the form torchtitan's HF text loader reads.

Embedded defaults: the corpus's held-out documents (never seen in pretraining) as JSON
lines with a "text" field, which `datasets.load_dataset("json")` feeds to torchtitan's
HuggingFaceTextDataset, at checkpoints/<key>/data/train.jsonl. Other models read the dataset
their config names (C4 on trn2) or DATASET=, so nothing is written for them.

A Hub dataset for fine-tuning (DATASET=org/name with DATASET_SPLIT and/or DATASET_COLUMNS) is
copied once: `datasets.load_dataset(id, split=…)`, columns renamed to the pipeline's (messages,
prompt/completion or text; e.g. messages=conversations), every record checked, written to
data/hub/<org>--<name>.jsonl with a record of where it came from. Training with DATASET=org/name
then reads that copy, chat or text as its keys say (pipeline.data.dataset).

DATASET=c4 stages a number of its shards once into the checkpoints root at a pinned revision
(pipeline.data.staged), which every rank then reads instead of streaming from the Hub.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pipeline import flags
from pipeline.checkpoint import corpus
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.run import store
from pipeline.run.settings import TrainSettings
from pipeline.data.data_files import copy_split, write_embedded_data
from pipeline.data import staged, user_data
from pipeline.training.resolve import RunRequest
from pipeline.data.dataset import FILE_FORMATS, HUB_ID, PREFERENCE_FILE, _copied_from, check_file, hub_copy, read_rows


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRequest, only=("model", "config", "target"))  # train's: its seq_len, its dataset
    flags.add_flags(parser, TrainSettings, unset_default=True, only=("dataset", "seq_len"))
    flags.add_flags(parser, user_data.DataRequest)


def run(args: argparse.Namespace) -> Path | None:
    home = store.home(args.model)
    store.mark_root(home.root, home.source.key)
    if args.dataset in staged.SHARDED:
        given = [n for n, v in (("DATASET_SPLIT", args.split), ("DATASET_EVAL_SPLIT", args.eval_split), ("DATASET_COLUMNS",
                 args.columns), ("DATASET_SUBSET", args.subset), ("EVAL_SPLIT", args.hold_out)) if v not in (None, "")]
        if given:
            raise PipelineError(f"{', '.join(given)} do not apply to DATASET={args.dataset} (staged shards).", "drop them.")
        return stage_sharded(home.root, args)
    if args.shards is not None or args.mirror:
        raise PipelineError(f"DATA_SHARDS and DATASET_MIRROR choose what to stage of "
                            f"{', '.join(staged.SHARDED)}; DATASET={args.dataset or '(unset)'} is not one.",
                            "give DATASET=c4, or drop them.")
    local = Path(args.dataset).expanduser() if args.dataset else None
    copy_asked = args.split or args.columns or args.eval_split or args.subset or args.dataset_revision
    if local is not None and local.is_dir() and not copy_asked and \
            _copied_from(copy := hub_copy(home.data_file.parent, args.dataset)) == str(local.resolve()):
        # every stage runs `data` first: a plain one never re-copies (with other settings) what `make data` copied
        print(f"DATASET={args.dataset}: already copied → {copy} (DATASET_COLUMNS=… and the other copy settings copy it again)")
        return copy
    if copy_asked or (local is not None and local.is_dir()):
        if not args.dataset or not HUB_ID.fullmatch(args.dataset) and not local.is_dir():
            raise PipelineError("DATASET_SPLIT, DATASET_SUBSET, DATASET_REVISION and DATASET_COLUMNS choose what to copy "
                                "of a Hub dataset; "
                                f"DATASET={args.dataset or '(unset)'} is not one.",
                                "give DATASET=<org/name> (or a local dataset directory), or drop them.")
        out = copy_split(home, args)
        report(home, args, out, held_out=None if args.eval_split else out.with_suffix(".eval.jsonl"))
        return out
    if local is not None and (local.suffix in FILE_FORMATS or local.is_file()):
        return report(home, args, local, held_out=None)
    if args.hold_out is not None:
        raise PipelineError(f"EVAL_SPLIT splits a file or a copied Hub dataset; DATASET={args.dataset or '(unset)'} "
                            "is neither.", "give DATASET=<file.jsonl>, or drop EVAL_SPLIT.")
    made = write_embedded_data(home.data_file)
    state = " (up to date)" if made.reused else ""
    print(f"training data{state}: {made.train} ({made.counts['documents']} held-out documents, "
          f"corpus sha256 {corpus.SHA256[:12]})")
    print(f"chat data (DATASET=chat){state}: {made.chat} ({made.counts['conversations']} conversations), "
          f"held out for eval: {made.chat_eval} ({made.counts['held_out']})")
    print(f"preference pairs (DATASET=preference, DPO){state}: {made.chat.with_name(PREFERENCE_FILE)} "
          f"({made.counts.get('pairs')} pairs), held out for eval: {made.counts.get('held_out_pairs')}")
    return made.train


def stage_sharded(root: Path, args: argparse.Namespace) -> Path:
    made = staged.stage(root, args.dataset, args.shards, args.dataset_revision, args.mirror)
    record = made.record
    size = sum(s["bytes"] for s in record["shards"]) / 2**20
    state = "up to date" if made.reused else "staged"
    print(f"DATASET={args.dataset} {state}: {len(record['shards'])} shard(s) of {record['repo_id']} at "
          f"{record['commit']} ({size:.1f} MiB, sha256 in {made.directory / staged.RECORD}) → {made.directory}; "
          "the ranks read these files")
    return made.directory


def report(home: store.ModelHome, args: argparse.Namespace, path: Path, held_out: Path | None) -> Path:
    """The whole file read with the ranks' reader and counted against SEQ_LEN; when it has no held-out
    split (held_out: where a copy's goes; None for a user's file), one is written (EVAL_SPLIT)."""
    from pipeline.models import registry
    from pipeline.run import settings as settings_mod, targets

    form = check_file(path)
    settings = settings_mod.load(targets.resolve(args.target).name, "native", registry.names(), args.config)
    seq_len = args.seq_len or settings.seq_len
    tokenizer = home.source_dir() if home.is_downloaded() else None
    if tokenizer is None and home.source.kind == "embedded":
        from pipeline.checkpoint.embedded import tokenizer_dir

        tokenizer = tokenizer_dir()
    counts = user_data.count(read_rows(path), path.name, form, tokenizer, seq_len)
    print(f"DATASET={args.dataset}: {counts.summary()}")
    if counts.fit == 0 and form != "text":
        print(f"warning: no record of DATASET={args.dataset} fits SEQ_LEN {seq_len}: a run on it would fail.")
    # Chat and preference data get a held-out split unless the config names its own (eval_dataset).
    default = 0.0 if form == "text" or settings.eval_dataset else user_data.DEFAULT_CHAT_SPLIT
    fraction = user_data.check_fraction(args.hold_out if args.hold_out is not None else default)
    if args.eval_split or not fraction:  # the dataset's own held-out split, or none asked
        return path
    if held_out is not None:  # a copy: its held-out records move beside it
        train, held = user_data.hold_out(user_data.json_lines(path), fraction)
        # the training copy first: cut short in between, the held-out records are missing, never also trained on
        atomic_write_text(path, "".join(line + "\n" for line in train))
        atomic_write_text(held_out, "".join(line + "\n" for line in held))
        record = path.with_suffix(".json")
        atomic_write_text(record, json.dumps({**json.loads(record.read_text()), "records": len(train),
                                              "eval_records": len(held), "eval_split_fraction": fraction},
                                             indent=2) + "\n")
        print(f"held out for eval (EVAL_SPLIT={fraction}): {len(held)} of {len(train) + len(held)} records → {held_out}")
        return path
    target, n_train, n_held = user_data.write_split(home.root, path, fraction)
    print(f"held out for eval (EVAL_SPLIT={fraction}): {n_held} of {n_train + n_held} records → {target / user_data.HELD_OUT}; "
          f"runs with DATASET={args.dataset} train on {target / user_data.TRAIN}")
    return target
