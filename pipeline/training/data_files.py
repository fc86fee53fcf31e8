"""The data files stage `data` writes: the embedded default's held-out text and chat conversations, and
a Hub dataset's split copied in the pipeline's columns (read back by pipeline.training.dataset)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint import corpus, manifest
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.training.dataset import CHAT_EVAL_FILE, CHAT_FILE


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


EMBEDDED_STAMP = ".embedded.json"  # beside train.jsonl: what made the embedded data files, and their sha256


@dataclass(frozen=True)
class EmbeddedData:
    train: Path
    chat: Path
    chat_eval: Path
    counts: dict[str, int]  # documents, conversations, held-out conversations
    reused: bool


def _maker() -> dict:
    """What the embedded data files are a function of: the pinned corpus and the code that cuts them."""
    return {"corpus_sha256": corpus.SHA256, "transformers": corpus.TRANSFORMERS_VERSION,
            "maker_sha256": manifest.sha256(Path(__file__))}


def _sha256(path: Path) -> str | None:
    return manifest.sha256(path) if path.is_file() else None


def write_embedded_data(train_file: Path) -> EmbeddedData:
    """train.jsonl, chat.jsonl and chat_eval.jsonl, rewritten only when the stamp beside them does not
    say they are exactly what this code makes of the pinned corpus (re-cutting it parses ~100
    transformers sources: most of `make data`'s time, paid before every training run)."""
    corpus.transformers_dir()  # refuses another transformers release: its sources would be another corpus
    chat, chat_eval = train_file.with_name(CHAT_FILE), train_file.with_name(CHAT_EVAL_FILE)
    stamp = train_file.with_name(EMBEDDED_STAMP)
    try:
        recorded = json.loads(stamp.read_text())
        if recorded["maker"] == _maker() and all(
                recorded["files"][p.name] == _sha256(p) for p in (train_file, chat, chat_eval)):
            return EmbeddedData(train_file, chat, chat_eval, dict(recorded["counts"]), reused=True)
    except (OSError, ValueError, TypeError, KeyError):  # no stamp, or not one this code wrote: cut them again
        pass
    stamp.unlink(missing_ok=True)  # no stamp describes files being rewritten
    corpus.checked_fingerprint()
    write_local_data(train_file)
    _, _, n_train, n_held = write_chat_data(train_file)
    counts = {"documents": len(corpus.held_out_documents()), "conversations": n_train, "held_out": n_held}
    atomic_write_text(stamp, json.dumps({"maker": _maker(), "counts": counts,
                                         "files": {p.name: _sha256(p) for p in (train_file, chat, chat_eval)}},
                                        indent=2) + "\n")
    return EmbeddedData(train_file, chat, chat_eval, counts, reused=False)


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
