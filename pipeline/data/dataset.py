"""DATASET: what a run trains on. Checked in the launcher before any rank starts; registered in
each rank with torchtitan's dataset registry (so torchtitan's own HF text loader reads it).

  local             the model's data/train.jsonl (written by `make data`)
  chat              the model's data/chat.jsonl: conversations (`make data`, embedded models)
  a .jsonl file     JSON lines, each an object with a "text" string, or chat records: "messages"
                    (system/user/assistant turns) or "prompt"/"completion" (pipeline.data.chat),
                    told apart by the first record's keys
  a .txt file       plain UTF-8 text, one document per paragraph (blank-line separated)
  c4                its shards staged once into <root>/data/sets/c4 (`make data DATASET=c4`,
                    pipeline.data.staged), read as local files by every rank; trn2's default
  c4_test, …        a torchtitan dataset (titan.api.titan_datasets())
  org/name          a Hub dataset: its local copy when `make data DATASET=org/name DATASET_SPLIT=…`
                    wrote one (hub_copy: fine-tuning sets, chat or text, any split and column
                    names), else streamed with a "text" column (split "train")
"""

from __future__ import annotations

import codecs
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.titan import api
from pipeline.data import staged, user_data

LOCAL = "local"
FILE_FORMATS = {".jsonl": "json", ".txt": "text"}
# The name each rank registers a file or Hub dataset under in torchtitan's DATASETS.
REGISTERED_NAME = {"file": "pipeline_file", "hub": "pipeline_hub", "staged": "pipeline_staged"}
EVAL_NAME = "pipeline_eval"  # the held-out file's (eval_file)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
# A "line" longer than this is no training document (and a file without newlines is not held whole).
LINE_BYTES_CHECKED = 64 << 20


HUB_COPIES = "hub"  # data/hub/<org>--<name>.jsonl: a Hub dataset's split as the data stage wrote it
CHAT = "chat"
CHAT_FILE = "chat.jsonl"  # beside the model's data/train.jsonl
CHAT_EVAL_FILE = "chat_eval.jsonl"  # its held-out conversations (eval loss; never trained on)
PREFERENCE = "preference"
PREFERENCE_FILE = "preference.jsonl"  # the embedded models' preference pairs (DATASET=preference, DPO)
PREFERENCE_EVAL_FILE = "preference_eval.jsonl"  # their held-out pairs
# The embedded data sets beside data/train.jsonl: DATASET name → (file, held-out file, format).
EMBEDDED_SETS = {CHAT: (CHAT_FILE, CHAT_EVAL_FILE, "chat"), PREFERENCE: (PREFERENCE_FILE, PREFERENCE_EVAL_FILE, "preference")}


@dataclass(frozen=True)
class DataSource:
    kind: str  # file | hub | titan | staged
    dataset: str  # DATASET as given
    file: str | None = None  # kind file: the absolute path read; staged: the set's directory
    format: str = "text"  # text | chat (a .jsonl file of conversations) | preference (pairs: DPO)

    @property
    def loader_name(self) -> str:
        """The dataset name torchtitan's HuggingFaceTextDataLoader is given."""
        return REGISTERED_NAME.get(self.kind, self.dataset)


def resolve(dataset: str, local_file: Path, check_local: bool = True, model: str = "…",
            root: Path | None = None) -> DataSource:
    """DATASET → a DataSource, refused in one line when it cannot be read. `local_file` is the
    model's data/train.jsonl (under the checkpoints root `root`, by default the one it is in); a dry
    run passes check_local=False (it may run before `make data`)."""
    if dataset in staged.SHARDED:
        where = staged.set_dir(root if root is not None else Path(local_file).parents[2], dataset)
        if check_local:
            staged.shard_files(where, dataset)
        return DataSource("staged", dataset, str(where))
    if dataset == LOCAL or dataset in EMBEDDED_SETS:
        file = Path(local_file) if dataset == LOCAL else Path(local_file).with_name(EMBEDDED_SETS[dataset][0])
        form = "text" if dataset == LOCAL else EMBEDDED_SETS[dataset][2]
        if check_local:
            if not file.exists():
                raise PipelineError(f"{file} does not exist (DATASET={dataset}).",
                                    f"run `make data MODEL={model}` first, or give DATASET=<file or dataset id>.")
            form = check_file(file)
        return DataSource("file", dataset, str(file), form)
    if dataset in api.titan_datasets():
        return DataSource("titan", dataset, titan_dataset_file(dataset, required=check_local))
    path = Path(dataset).expanduser()
    if path.is_dir():  # a local dataset directory: read through the copy `make data` made of it
        copy = hub_copy(Path(local_file).parent, dataset)
        copied_from = _copied_from(copy)
        if copied_from != str(path.resolve()):
            said = f"its copy {copy} is of {copied_from}" if copied_from else "it has not been copied"
            raise PipelineError(f"DATASET={dataset} is a dataset directory and {said}.",
                                f"run `make data MODEL={model} DATASET={dataset} [DATASET_SPLIT=…] [DATASET_COLUMNS=…]` "
                                "first (it copies a split in the pipeline's columns).")
        return DataSource("file", dataset, str(copy), check_file(copy))
    if path.suffix in FILE_FORMATS or path.exists() or dataset.startswith(("/", ".", "~")):
        form = check_file(path)
        split = user_data.find_split(root if root is not None else Path(local_file).parents[2], path)
        if split is not None:  # `make data` held records out of this file (as it is now): train on the rest
            return DataSource("file", dataset, str(split / user_data.TRAIN), form)
        return DataSource("file", dataset, str(path.resolve()), form)
    if HUB_ID.fullmatch(dataset):
        copy = hub_copy(Path(local_file).parent, dataset)
        if copy.exists():  # a split the data stage copied, columns renamed: read like any file
            return DataSource("file", dataset, str(copy), check_file(copy))
        return DataSource("hub", dataset)
    raise PipelineError(f"DATASET={dataset!r} is not {LOCAL!r}, a .jsonl/.txt file, a torchtitan dataset "
                        f"({', '.join(api.titan_datasets())}) or a Hub dataset id (org/name).",
                        "check the spelling, or give the path of an existing file.")


def _copied_from(copy: Path) -> str | None:
    """The dataset a copy's record (beside it) says it was made from."""
    from pipeline.fsutil import read_small_text

    try:
        return json.loads(read_small_text(copy.with_suffix(".json")))["dataset"] if copy.is_file() else None
    except (OSError, ValueError, TypeError, KeyError, PipelineError):
        return None


def hub_copy(data_dir: Path, dataset: str) -> Path:
    """Where the data stage writes a Hub dataset's split (its record beside it, .json); a local dataset
    directory's copy is named by the directory."""
    name = dataset.replace("/", "--") if HUB_ID.fullmatch(dataset) else Path(dataset).expanduser().resolve().name
    return Path(data_dir) / HUB_COPIES / f"{name}.jsonl"


def check_file(path: Path) -> str:
    """The file exists, is a regular readable file, and all of it reads as the ranks read it: strict
    UTF-8 (datasets' json and text builders refuse anything else), and for JSON lines every line a
    record of the file's format, every conversation's roles included (the first record decides: text
    or chat). Returns the format."""
    where = f"DATASET file {path}"
    if path.is_dir():
        raise PipelineError(f"{where} is a directory.", "give a .jsonl or .txt file.")
    if path.suffix not in FILE_FORMATS:
        raise PipelineError(f"{where} has suffix {path.suffix!r}; only {', '.join(FILE_FORMATS)} are read.",
                            "convert it to JSON lines with a \"text\" field, or to plain text.")
    if path.exists() and not path.is_file():  # a device (/dev/zero never ends), a FIFO, a socket
        raise PipelineError(f"{where} is not a regular file{f' (it links to {path.resolve()})' if path.is_symlink() else ''}.",
                            "give a .jsonl or .txt file.")
    try:
        with open(path, "rb") as handle:
            if FILE_FORMATS[path.suffix] == "text":
                return _check_text(handle, where)
            return _check_lines(handle, where)
    except FileNotFoundError as err:
        raise PipelineError(f"{where} does not exist.", "check the path.") from err
    except PermissionError as err:
        raise PipelineError(f"{where} is not readable ({err.strerror}).", "fix its permissions.") from err


def _check_text(handle, where: str) -> str:
    decoder = codecs.getincrementaldecoder("utf-8")()
    read, blank = 0, True
    try:
        for block in iter(lambda: handle.read(1 << 20), b""):
            blank = blank and not decoder.decode(block).strip()
            read += len(block)
        decoder.decode(b"", final=True)
    except UnicodeDecodeError as err:
        raise PipelineError(f"{where} is not UTF-8 text (byte {read + err.start}).", "save it as UTF-8.") from err
    if blank:
        raise PipelineError(f"{where} is empty.", "give a file with training text.")
    return "text"


def _check_lines(handle, where: str) -> str:
    form, number = None, 0
    while raw := handle.readline(LINE_BYTES_CHECKED + 1):
        number += 1
        if len(raw) > LINE_BYTES_CHECKED:
            raise PipelineError(f"{where}:{number} is longer than {LINE_BYTES_CHECKED >> 20} MiB; JSON lines hold one "
                                "document per line.", "write one JSON object per line, e.g. {\"text\": \"…\"}.")
        if not raw.strip():
            continue
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            raise PipelineError(f"{where}:{number} is not UTF-8 (byte {err.start} of the line).",
                                "save the file as UTF-8.") from err
        form = check_record(line, where, number, form)
    if form is None:
        raise PipelineError(f"{where} is empty.", "give a file with training text.")
    return form


def check_record(line: str, where: str, number: int, form: str | None = None) -> str:
    """One JSON line against the file's format (None: this line decides it); returns the format."""
    from pipeline.data import chat, preference

    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PipelineError(f"{where}:{number} is not JSON ({err.msg}).",
                            "write one JSON object per line, e.g. {\"text\": \"…\"}.") from err
    if form is None:
        form = ("preference" if isinstance(record, dict) and preference.is_preference_record(record) else
                "chat" if isinstance(record, dict) and chat.is_chat_record(record) else "text")
    if form in ("preference", "chat"):
        # (what checks a record, what told the file's kind, what a record looks like)
        problem_of, told, shape = {
            "preference": (preference.pair_problem, "\"chosen\" and \"rejected\"",
                           "{\"prompt\": …, \"chosen\": …, \"rejected\": …} (strings, or lists of messages), "
                           "with chosen and rejected different"),
            "chat": (chat.conversation_problem, "\"messages\" or \"prompt\"/\"completion\"",
                     "{\"messages\": [{\"role\": \"user\", \"content\": …}, {\"role\": \"assistant\", "
                     "\"content\": …}]} or {\"prompt\": …, \"completion\": …}"),
        }[form]
        problem = problem_of(record)
        if problem:
            raise PipelineError(f"{where}:{number} {problem} (the file is {form} data: its first record has {told}).",
                                f"give every line {shape}.")
        return form
    if not isinstance(record, dict) or not isinstance(record.get("text"), str):
        raise PipelineError(f"{where}:{number} has no \"text\" string (keys: "
                            f"{sorted(record) if isinstance(record, dict) else type(record).__name__}).",
                            "give every line a \"text\" field holding the document, or make it chat data "
                            "(\"messages\", or \"prompt\" and \"completion\").")
    return form


def check_readable(source: DataSource) -> None:
    """The whole dataset opens as the ranks will open it (FRESH=1 checks this before it deletes
    anything): every line of a file, or a Hub / torchtitan dataset reachable from here."""
    if source.kind == "staged":
        staged.shard_files(Path(source.file), source.dataset, check_sha256=True)
        return
    if source.kind == "file":
        check_file(Path(source.file))  # every line, as resolve reads it
        open_in_rank(source)  # and through the ranks' own loader (datasets), whose cache they then reuse
        return
    hub_id = source.dataset if source.kind == "hub" else api.titan_datasets()[source.dataset]
    if source.kind == "titan" and not HUB_ID.fullmatch(hub_id):
        return  # a local path, checked by resolve
    from datasets import load_dataset_builder

    try:
        load_dataset_builder(hub_id)
    except Exception as err:  # offline, unknown id, gated: datasets raises many kinds
        raise PipelineError(f"DATASET={source.dataset} ({hub_id}) cannot be opened from here: "
                            f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                            "check the id and the network (or HF_HUB_OFFLINE and the datasets cache), "
                            "or give DATASET=<file>.") from err


def check_documents(source: DataSource, data_ranks: int) -> None:
    """A file must give every data-parallel rank at least one document: torchtitan splits the
    documents between them, and a rank left without any fails inside its loader (IndexError)."""
    if source.kind != "file" or not Path(source.file).is_file():
        return  # streamed and torchtitan datasets are large; a dry run before `make data` has no file yet
    found = count_documents(Path(source.file), data_ranks)
    if found < data_ranks:
        raise PipelineError(f"DATASET file {source.file} holds {found} document(s), fewer than the {data_ranks} "
                            "data-parallel ranks that split it.",
                            f"give a file with at least {data_ranks} documents, or fewer ranks (NPROC).")


def count_documents(path: Path, enough: int) -> int:
    """Documents in a .jsonl (non-empty lines) or .txt file (blank-line separated paragraphs), counted
    only up to `enough`: the file is read no further than that."""
    paragraphs = FILE_FORMATS[path.suffix] == "text"
    count, in_document, line_start = 0, False, True
    with open(path, "rb") as handle:
        while line := handle.readline(1 << 20):  # a bounded piece of a line: a huge one is not held whole
            starts, line_start = line_start, line.endswith(b"\n")
            if not starts:
                continue
            blank = not line.strip()
            if paragraphs:
                if not blank and not in_document:
                    count += 1
                in_document = not blank
            elif not blank:
                count += 1
            if count >= enough:
                break
    return count


def titan_dataset_file(name: str, required: bool = True) -> str | None:
    """Where a torchtitan dataset read from local files (c4_test: tests/assets/…, relative to the working
    directory in torchtitan's registry) is, found the way torchtitan's test tokenizer is
    (pipeline.titan.assets: the working directory, else the installed torchtitan's source
    checkout, which the image's torchtitan-neuron is installed from). None for a Hub dataset, and when not
    `required` (a dry run or a cluster launch: the ranks look for it where they run)."""
    from pipeline.titan import assets

    relative = api.titan_datasets()[name]
    if HUB_ID.fullmatch(relative):
        return None
    found = assets.find(relative)
    if found is None and required:
        raise PipelineError(f"DATASET={name} reads torchtitan's {relative}, found neither in {Path.cwd()} nor in "
                            "the installed torchtitan's source checkout.",
                            "install torchtitan from a source checkout (pip install -e, as torchtitan-neuron is), "
                            "run from one, or give DATASET=<file>.")
    return str(found) if found is not None else None


def register(source: DataSource, name: str | None = None) -> str:
    """In a rank: add a file or Hub dataset to torchtitan's registry (under `name`, default the
    kind's registered name); returns the loader's name."""
    if source.kind == "titan":
        # torchtitan reads a local one relative to the working directory: it is given the path found
        # (the launcher's, or, where the launcher did not look, the rank's own; refused when neither finds it)
        location = source.file or titan_dataset_file(source.dataset)
        if location is not None:
            api.relocate_titan_dataset(source.dataset, location)
        return source.loader_name
    if source.format in ("chat", "preference"):  # data.chat's / data.preference's own loader reads the file
        return source.loader_name
    if source.kind == "staged":  # the staged shards, JSON lines (datasets' json builder reads .json.gz)
        directory = Path(source.file)
        # A dry run may come before `make data` (a launch file's staging step runs it first): the set's folder
        # stands for its shards there; a rank reads only a staged set (open_in_rank checks its record first).
        files = staged.shard_files(directory, source.dataset) if staged.read_record(directory) else str(directory)
        api.register_text_dataset(name or source.loader_name, "file", files,
                                  "json", wrap_loader=lambda loader: _one_line_errors(loader, source))
        return name or source.loader_name
    if source.kind == "file":
        api.register_text_dataset(name or source.loader_name, "file", source.file,
                                  FILE_FORMATS[Path(source.file).suffix],
                                  wrap_loader=lambda loader: _one_line_errors(loader, source))
    else:
        api.register_text_dataset(name or source.loader_name, "hub", source.dataset, None,
                                  wrap_loader=lambda loader: _one_line_errors(loader, source))
    return name or source.loader_name


def read_rows(path: Path):
    """A user's file's records through the ranks' reader (datasets), its errors one line as in the ranks."""
    from datasets import load_dataset

    builder, extra = ("text", {"sample_by": "paragraph"}) if Path(path).suffix == ".txt" else ("json", {})
    return _one_line_errors(lambda files: load_dataset(builder, data_files=files, split="train", **extra),
                            DataSource("file", str(path), str(path)))(str(path))


def open_in_rank(source: DataSource) -> None:
    """In a rank, before torchtitan's Trainer is built: open a file dataset as its loader will (the
    datasets cache makes the loader's own open cheap). An error here is the rank's one line; inside
    the Trainer's constructor torchrun's error record would add a traceback per rank."""
    if source.kind not in ("file", "staged"):
        return
    from datasets import load_dataset

    if source.kind == "staged":
        files, builder = staged.shard_files(Path(source.file), source.dataset), "json"
    else:
        files, builder = source.file, "json" if FILE_FORMATS[Path(source.file).suffix] == "json" else "text"
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    import datasets

    shown = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()  # a check before the run: its "Generating train split" bars are noise
    try:
        _one_line_errors(lambda path: load_dataset(builder, data_files=path, split="train", **extra), source)(files)
    finally:
        if shown:
            datasets.enable_progress_bars()


def _one_line_errors(loader, source: DataSource):
    """A loader whose failure to open the data stops the rank with one line (failure.json), which the
    launcher reports, instead of a traceback from every rank."""
    def load(path):
        try:
            return loader(path)
        except Exception as err:  # datasets raises many kinds (DatasetGenerationError, FileNotFoundError, …)
            cause = str(err).splitlines()[0] if str(err) else ""
            raise PipelineError(f"the ranks cannot open DATASET={source.dataset} ({path}): {type(err).__name__}: {cause}",
                                "check the data (FRESH=1 reads all of it before it starts a run).") from err
    return load


def eval_file(settings, data: DataSource, local_file: Path, check_local: bool = True) -> str | None:
    """The held-out file eval loss is computed on: `eval_dataset` when given (a file of the training
    data's format), else the dataset's own held-out split (DATASET=chat: data/chat_eval.jsonl; a Hub
    copy: the DATASET_EVAL_SPLIT copied beside it), else None (no eval). Never the training file itself."""
    if settings.eval_every <= 0:
        return None
    if settings.eval_steps < 1:
        raise PipelineError(f"eval_steps = {settings.eval_steps}: eval needs at least one batch.",
                            "set eval_steps ≥ 1, or eval_every = 0 to turn eval off.")
    if not settings.eval_dataset:
        held_copy = Path(data.file).with_suffix(".eval.jsonl") if data.file else None
        if data.file and Path(data.file).parent.name == HUB_COPIES and held_copy.exists():
            return str(held_copy)  # the Hub dataset's eval split, copied beside its training split
        held_split = Path(data.file).with_name(user_data.HELD_OUT) if data.file else None
        if data.file and Path(data.file).name == user_data.TRAIN and held_split.is_file():
            return str(held_split)  # the records `make data` held out of the user's file
        if data.dataset not in EMBEDDED_SETS:
            if data.dataset != LOCAL:  # the user's data; the model's own text has no held-out split by design
                print(f"note: eval_every = {settings.eval_every} but DATASET={data.dataset} has no held-out split: "
                      f"nothing will be evaluated. Fix: `make data DATASET={data.dataset}` writes one (EVAL_SPLIT=<fraction>), "
                      "or set eval_dataset = \"<file>\", or eval_every = 0.", file=sys.stderr, flush=True)
            return None
        held = Path(local_file).with_name(EMBEDDED_SETS[data.dataset][1])
        if check_local and not held.exists():
            raise PipelineError(f"{held} does not exist (the held-out split of DATASET={data.dataset}).",
                                "run `make data` again (it writes both), or set eval_every = 0.")
        return str(held)
    path = Path(settings.eval_dataset).expanduser()
    form = check_file(path)
    if form != data.format:
        raise PipelineError(f"eval_dataset {path} is {form} data and the training data is {data.format}.",
                            "give a held-out file of the same kind.")
    if data.file and path.resolve() == Path(data.file).resolve():
        raise PipelineError(f"eval_dataset {path} is the training file: its loss says nothing about held-out data.",
                            "give a held-out file the run does not train on.")
    return str(path.resolve())
