"""The data files stage `data` writes: the embedded default's held-out text and chat conversations, and
a Hub dataset's split copied in the pipeline's columns (read back by pipeline.data.dataset)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint import corpus, manifest
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text, read_json_object
from pipeline.data.dataset import CHAT_EVAL_FILE, CHAT_FILE, PREFERENCE_EVAL_FILE, PREFERENCE_FILE


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


def preference_pairs(chats: list[dict]) -> list[dict]:
    """TRL's conversational preference pairs made of the chat set: the prompt is a conversation's system and first
    user turn, chosen the assistant's continuation of the quoted words, rejected the next conversation's (text
    that does not continue them)."""
    out = []
    for at, record in enumerate(chats):
        chosen, rejected = record["messages"][2], chats[(at + 1) % len(chats)]["messages"][2]
        if chosen["content"] != rejected["content"]:
            out.append({"prompt": record["messages"][:2], "chosen": [chosen], "rejected": [rejected]})
    return out


def _write_split(records: list[dict], train_path: Path, held_path: Path) -> tuple[Path, Path, int, int]:
    """A deterministic split, every CHAT_EVAL_EVERY-th record held out."""
    train = [r for i, r in enumerate(records) if i % CHAT_EVAL_EVERY != CHAT_EVAL_EVERY - 1]
    held = [r for i, r in enumerate(records) if i % CHAT_EVAL_EVERY == CHAT_EVAL_EVERY - 1]
    for path, rows in ((train_path, train), (held_path, held)):
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in rows))
    return train_path, held_path, len(train), len(held)


def write_chat_data(train_file: Path) -> tuple[Path, Path, int, int]:
    """data/chat.jsonl and data/chat_eval.jsonl, every CHAT_EVAL_EVERY-th conversation held out."""
    records = conversations(corpus.held_out_documents())
    return _write_split(records, train_file.with_name(CHAT_FILE), train_file.with_name(CHAT_EVAL_FILE))


def write_preference_data(train_file: Path) -> tuple[Path, Path, int, int]:
    """data/preference.jsonl and data/preference_eval.jsonl (DATASET=preference), every CHAT_EVAL_EVERY-th pair
    held out."""
    records = preference_pairs(conversations(corpus.held_out_documents()))
    return _write_split(records, train_file.with_name(PREFERENCE_FILE), train_file.with_name(PREFERENCE_EVAL_FILE))


EMBEDDED_STAMP = ".embedded.json"  # beside train.jsonl: what made the embedded data files, and their sha256


@dataclass(frozen=True)
class EmbeddedData:
    train: Path
    chat: Path
    chat_eval: Path
    counts: dict[str, int]  # documents, conversations, held-out conversations, pairs, held-out pairs
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
    files = (train_file, chat, chat_eval, train_file.with_name(PREFERENCE_FILE), train_file.with_name(PREFERENCE_EVAL_FILE))
    stamp = train_file.with_name(EMBEDDED_STAMP)
    try:
        recorded = read_json_object(stamp, "none: the files are cut again.")
        if recorded["maker"] == _maker() and all(recorded["files"][p.name] == _sha256(p) for p in files):
            return EmbeddedData(train_file, chat, chat_eval, dict(recorded["counts"]), reused=True)
    except (OSError, ValueError, TypeError, KeyError, PipelineError):  # no stamp, or not one this code wrote: cut them again
        pass
    stamp.unlink(missing_ok=True)  # no stamp describes files being rewritten
    corpus.checked_fingerprint()
    write_local_data(train_file)
    _, _, n_train, n_held = write_chat_data(train_file)
    _, _, n_pairs, n_held_pairs = write_preference_data(train_file)
    counts = {"documents": len(corpus.held_out_documents()), "conversations": n_train, "held_out": n_held,
              "pairs": n_pairs, "held_out_pairs": n_held_pairs}
    atomic_write_text(stamp, json.dumps({"maker": _maker(), "counts": counts,
                                         "files": {p.name: _sha256(p) for p in files}},
                                        indent=2) + "\n")
    return EmbeddedData(train_file, chat, chat_eval, counts, reused=False)


OUR_COLUMNS = ("messages", "prompt", "completion", "chosen", "rejected", "text")


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


CHAT_COLUMNS = ("messages", "prompt", "completion")


def columns_to_copy(columns: dict[str, str], available: list[str], where: str) -> dict[str, str]:
    """ours → theirs for every column the copy holds, one format only: the mapping given, then their
    columns already named as ours of the format it implies (text=summary copies `summary` as "text",
    never their own `text`; a chat mapping drops an unmapped `text`). Refused in one line when a
    mapped column is missing or the copy would hold text and chat columns at once."""
    missing = sorted(set(columns.values()) - set(available))
    if missing:
        raise PipelineError(f"{where} has no column {', '.join(missing)} (it has {', '.join(available)}).",
                            "fix DATASET_COLUMNS.")
    if "text" in columns and set(columns) & set(CHAT_COLUMNS):
        raise PipelineError(f"DATASET_COLUMNS maps both text and chat columns ({', '.join(sorted(columns))}): a "
                            "copy is text or chat data, not both.", "map either text=… or messages=… / prompt=…,completion=….")
    # their columns already named as ours, unless the mapping takes that name or copies the column as another
    copied = {**{c: c for c in available if c in OUR_COLUMNS and c not in columns.values()}, **columns}
    if columns:  # a mapping says which format the copy is
        keep = ("text",) if "text" in columns else CHAT_COLUMNS
    else:
        chat = "messages" in copied or {"prompt", "completion"} <= set(copied)
        if chat and "text" in copied:
            raise PipelineError(f"{where} has a text column and chat columns ({', '.join(sorted(copied))}).",
                                "say which to copy: DATASET_COLUMNS=text=text, or messages=messages "
                                "(prompt=prompt,completion=completion).")
        keep = CHAT_COLUMNS if chat else ("text",)
    if keep == CHAT_COLUMNS:  # one chat form: messages, else prompt and completion
        keep = ("messages",) if "messages" in copied else ("prompt", "completion")
    return {ours: theirs for ours, theirs in copied.items() if ours in keep}


def copy_hub_dataset(dataset: str, split: str, columns: dict[str, str], out: Path, name: str | None = None,
                     revision: str | None = None) -> tuple[int, str, dict[str, str]]:
    """The split (of subset `name`, at `revision`) as JSON lines of the pipeline's columns, each record
    checked; returns (records, format, the columns copied: ours → theirs)."""
    from datasets import load_dataset
    from tqdm import tqdm

    from pipeline.data.dataset import check_record

    try:
        rows = load_dataset(dataset, name, split=split, revision=revision)
    except Exception as err:  # offline, unknown id or split, gated: datasets raises many kinds
        raise PipelineError(f"DATASET={dataset}{f' subset {name!r}' if name else ''} split {split!r} cannot be loaded: "
                            f"{type(err).__name__}: "
                            f"{str(err).splitlines()[0] if str(err) else ''}",
                            "check the id, DATASET_SPLIT and the network (HF_TOKEN for gated sets).") from err
    copied = columns_to_copy(columns, list(rows.column_names), f"DATASET={dataset} split {split!r}")
    if not copied:
        raise PipelineError(f"DATASET={dataset} split {split!r} has none of the columns "
                            f"{', '.join(OUR_COLUMNS)} (it has {', '.join(rows.column_names)}).",
                            "map one with DATASET_COLUMNS, e.g. text=<their column> or messages=<their column>.")
    form, lines = None, []
    for number, row in enumerate(tqdm(rows, desc=f"copying {dataset}:{split}", unit="rec",
                                      disable=len(rows) < 10_000), 1):
        line = json.dumps({ours: row[theirs] for ours, theirs in copied.items()}, ensure_ascii=False)
        form = check_record(line, f"DATASET={dataset} split {split!r}", number, form)
        lines.append(line + "\n")
    if not lines:
        raise PipelineError(f"DATASET={dataset} split {split!r} is empty.", "choose another DATASET_SPLIT.")
    atomic_write_text(out, "".join(lines))
    return len(lines), form, copied


def copy_split(home, args) -> Path:
    """A Hub dataset's (or local dataset directory's) split, and its held-out split, in our columns; the
    record beside them written last, saying what was copied (a failure leaves no record, and no copy of
    one half)."""
    from pipeline.data.dataset import hub_copy

    out = hub_copy(home.data_file.parent, args.dataset)
    split, columns = args.split or "train", parse_columns(args.columns)
    if args.eval_split == split:
        raise PipelineError(f"DATASET_EVAL_SPLIT={split} is the training split: its loss says nothing "
                            "about held-out data.", "give the dataset's held-out split (e.g. test).")
    record, held = out.with_suffix(".json"), out.with_suffix(".eval.jsonl")
    record.unlink(missing_ok=True)  # no record describes a copy being replaced
    where = {"name": args.subset, "revision": args.dataset_revision}
    count, form, copied = copy_hub_dataset(args.dataset, split, columns, out, **where)
    held_count = None
    if args.eval_split:
        try:
            held_count, held_form, _ = copy_hub_dataset(args.dataset, args.eval_split, columns, held, **where)
        except PipelineError:
            out.unlink(missing_ok=True)
            raise
        if held_form != form:
            held.unlink()
            out.unlink()
            raise PipelineError(f"split {args.eval_split!r} is {held_form} data and {split!r} is {form}.",
                                "give a held-out split of the same kind.")
    else:
        held.unlink(missing_ok=True)  # an earlier copy's eval split is not this one's
    local = Path(args.dataset).expanduser()
    atomic_write_text(record, json.dumps({
        "dataset": str(local.resolve()) if local.is_dir() else args.dataset, "split": split,
        "subset": args.subset, "revision": args.dataset_revision, "commit": hub_commit(args.dataset, args.dataset_revision),
        "columns": copied, "columns_given": columns, "records": count, "format": form,
        "eval_split": args.eval_split or None, "eval_records": held_count}, indent=2) + "\n")
    print(f"DATASET={args.dataset} split {split!r}: {count} {form} records → {out} (columns "
          f"{', '.join(f'{o} ← {t}' for o, t in copied.items())}); runs with DATASET={args.dataset} read it")
    if held_count is not None:
        print(f"held out for eval: split {args.eval_split!r}, {held_count} records → {held}")
    return out


def hub_commit(dataset: str, revision: str | None) -> str | None:
    """The commit a Hub dataset's revision is, recorded with its copy (None for a local directory)."""
    from pipeline.data.dataset import HUB_ID

    if not HUB_ID.fullmatch(dataset) or Path(dataset).expanduser().is_dir():
        return None
    from huggingface_hub import HfApi

    try:
        return HfApi().dataset_info(dataset, revision=revision).sha
    except Exception:  # noqa: BLE001 - any failure to reach the Hub is one case: offline (the copy came from the datasets cache): the revision asked is what is known
        return None
