"""A user's dataset as `make data DATASET=<file or folder>` sees it: read whole with the ranks' own reader
(datasets' json/text builder, as pipeline.data.dataset.open_in_rank opens it), counted in the model's
tokens against SEQ_LEN with the ranks' rules (a conversation longer than SEQ_LEN is dropped, as
pipeline.data.chat does; text is packed across windows, nothing dropped), and split deterministically
into train and held-out records when the data has no held-out split of its own (EVAL_SPLIT; default
DEFAULT_CHAT_SPLIT of a chat set, none of text: axolotl's `val_set_size`, LLaMA-Factory's `val_size`).

A file's split lives in <root>/data/sets/<stem>-<first 12 of its sha256>/ (train.jsonl, eval.jsonl and
source.json, which names the file, its sha256 and the fraction): a run with DATASET=<that file> reads
train.jsonl and evaluates on eval.jsonl while the file is unchanged (pipeline.data.dataset.resolve).
"""

from __future__ import annotations

import glob
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.flags import flag
from pipeline.fsutil import atomic_directory, atomic_write_text
from pipeline.data.staged import SETS

DEFAULT_CHAT_SPLIT = 0.05
RECORD = "source.json"
TRAIN, HELD_OUT = "train.jsonl", "eval.jsonl"


@dataclass(frozen=True)
class DataRequest:
    """What `make data` asks for beyond the model and the settings it shares with train (DATASET, SEQ_LEN,
    CONFIG, TARGET): how a Hub dataset is copied, c4 staged and a held-out split made. Its fields are the
    `data` stage's flags (pipeline.flags) and Make variables (pipeline.host.makevars)."""

    split: str | None = flag(None, "a Hub dataset's split to copy for fine-tuning (data/hub/; runs with DATASET then "
                             "read the copy)", make="DATASET_SPLIT", make_default="train")
    eval_split: str | None = flag(None, "its held-out split, copied beside it for eval loss (e.g. test)",
                                  make="DATASET_EVAL_SPLIT")
    columns: str = flag("", "our name=their column, comma-separated (messages, prompt, completion, text), e.g. "
                        "messages=conversations or prompt=question,completion=answer", make="DATASET_COLUMNS")
    shards: int | None = flag(None, "DATASET=c4: train shards staged once into <checkpoints>/data/sets/c4, which the "
                              "ranks read (default: what is staged, else 8)", make="DATA_SHARDS", make_default="8")
    dataset_revision: str | None = flag(None, "the Hub dataset's revision (a commit) copied, or staged for DATASET=c4; "
                                        "recorded with the copy", make="DATASET_REVISION", make_default="main")
    mirror: Path | None = flag(None, "DATASET=c4: a local directory laid out like the Hub repository, read instead "
                               "of the Hub", make="DATASET_MIRROR")
    subset: str | None = flag(None, "a Hub dataset's subset (config name), e.g. en; recorded with the copy",
                              make="DATASET_SUBSET")
    hold_out: float | None = flag(None, "EVAL_SPLIT: the fraction of DATASET held out for eval loss, deterministically, "
                                  f"when the data has no held-out split (default {DEFAULT_CHAT_SPLIT} of chat data, 0 "
                                  "of text)", make="EVAL_SPLIT", make_default=f"{DEFAULT_CHAT_SPLIT} of chat data")


@dataclass(frozen=True)
class Counts:
    form: str  # text | chat | preference
    records: int
    tokens: int | None  # None: no tokenizer here (the model is not downloaded)
    fit: int | None  # records of at most seq_len tokens
    seq_len: int

    def summary(self) -> str:
        unit = {"chat": "conversations", "preference": "preference pairs"}.get(self.form, "documents")
        if self.tokens is None:
            return f"{self.records} {unit} (tokens not counted: the model's tokenizer is not here yet)"
        longer = self.records - self.fit
        fate = f"{longer} longer, packed across windows" if self.form == "text" else f"{longer} longer, dropped"
        return (f"{self.records} {unit}, {self.tokens:,} tokens; {self.fit} fit SEQ_LEN {self.seq_len}, {fate}")


def count(rows, name: str, form: str, tokenizer_dir: Path | None, seq_len: int) -> Counts:
    """Every record of a file (`rows`: read by the ranks' reader, dataset.read_rows), counted in tokens with the
    ranks' rules."""
    if tokenizer_dir is None:
        return Counts(form, len(rows), None, None, seq_len)
    from torchtitan.components.tokenizer import HuggingFaceTokenizer
    from tqdm import tqdm

    from pipeline.data import chat, preference

    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir))
    end = chat.turn_end(tokenizer) if form == "chat" else None
    tokens, fit = 0, 0
    for row in tqdm(rows, desc=f"counting tokens of {name}", unit="rec", disable=len(rows) < 1000):
        if form == "chat":
            ids, _labels = chat.tokenize_conversation(tokenizer, chat.to_messages(row), 1 << 62, end)
            length = len(ids)  # inputs: the conversation less its last token, what must fit seq_len
        elif form == "preference":  # both sides must fit, as the ranks' pair loader drops a pair otherwise
            sides = [len(ids) for ids, _labels in preference.tokenize_pair(tokenizer, row, 1 << 62)]
            length = max(sides)
            tokens += sum(sides) - length - 1
        else:
            length = len(tokenizer.encode(row["text"], add_bos=True, add_eos=True)) - 1
        tokens += length + 1
        fit += length <= seq_len
    return Counts(form, len(rows), tokens, fit, seq_len)


def hold_out(lines: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """(train, held out): the records whose sha256 sorts first, round(fraction × n) of them (at least one),
    in file order each: the same file always splits the same way, whatever its order."""
    ranked = sorted(range(len(lines)), key=lambda i: (hashlib.sha256(lines[i].encode()).hexdigest(), i))
    held = set(ranked[:max(1, round(fraction * len(lines)))])
    if len(held) >= len(lines):
        raise PipelineError(f"EVAL_SPLIT={fraction} of {len(lines)} record(s) leaves nothing to train on.",
                            "give more records, a smaller EVAL_SPLIT, or EVAL_SPLIT=0.")
    return [line for i, line in enumerate(lines) if i not in held], [line for i, line in enumerate(lines) if i in held]


def check_fraction(fraction: float) -> float:
    if not 0 <= fraction < 1:
        raise PipelineError(f"EVAL_SPLIT={fraction} is not a fraction in [0, 1).", "e.g. EVAL_SPLIT=0.05, or 0 for none.")
    return fraction


def json_lines(path: Path) -> list[str]:
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def split_dir(root: Path, path: Path, digest: str) -> Path:
    return Path(root) / SETS / f"{path.stem}-{digest[:12]}"


def write_split(root: Path, path: Path, fraction: float) -> tuple[Path, int, int]:
    """The file's deterministic split into <root>/data/sets/<stem>-<sha>/; returns (dir, train, held out)."""
    from pipeline.checkpoint import manifest

    if path.suffix != ".jsonl":
        raise PipelineError(f"EVAL_SPLIT={fraction} splits JSON lines; {path} is {path.suffix} text.",
                            "convert it to JSON lines ({\"text\": …} per line), give eval_dataset=<file>, or EVAL_SPLIT=0.")
    digest = manifest.sha256(path)
    train, held = hold_out(json_lines(path), fraction)
    target = split_dir(root, path, digest)
    with atomic_directory(target, replace=True) as tmp:
        atomic_write_text(tmp / TRAIN, "".join(line + "\n" for line in train))
        atomic_write_text(tmp / HELD_OUT, "".join(line + "\n" for line in held))
        atomic_write_text(tmp / RECORD, json.dumps({"file": str(path.resolve()), "sha256": digest,
                                                    "eval_split": fraction, "train_records": len(train),
                                                    "eval_records": len(held)}, indent=2) + "\n")
    return target, len(train), len(held)


def find_split(root: Path, path: Path) -> Path | None:
    """The split `make data` wrote of this file as it is now (its sha256), or None."""
    from pipeline.checkpoint import manifest

    sets = Path(root) / SETS
    if not sets.is_dir() or not any(sets.glob(glob.escape(path.stem) + "-*")):
        return None  # nothing to hash the file for
    target = split_dir(root, path, manifest.sha256(path))
    return target if (target / RECORD).is_file() and (target / TRAIN).is_file() else None
