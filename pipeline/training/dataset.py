"""DATASET: what a run trains on. Checked in the launcher before any rank starts; registered in
each rank with torchtitan's dataset registry (so torchtitan's own HF text loader reads it).

  local             the model's data/train.jsonl (written by `make data`)
  chat              the model's data/chat.jsonl: conversations (`make data`, embedded models)
  a .jsonl file     JSON lines, each an object with a "text" string, or chat records: "messages"
                    (system/user/assistant turns) or "prompt"/"completion" (pipeline.training.chat),
                    told apart by the first record's keys
  a .txt file       plain UTF-8 text, one document per paragraph (blank-line separated)
  c4, c4_test, …    a torchtitan dataset (titan.api.titan_datasets()); C4 is trn2's default
  org/name          a Hub dataset: its local copy when `make data DATASET=org/name DATASET_SPLIT=…`
                    wrote one (hub_copy: fine-tuning sets, chat or text, any split and column
                    names), else streamed with a "text" column (split "train")
"""

from __future__ import annotations

import codecs
import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.titan import api

LOCAL = "local"
FILE_FORMATS = {".jsonl": "json", ".txt": "text"}
# The name each rank registers a file or Hub dataset under in torchtitan's DATASETS.
REGISTERED_NAME = {"file": "pipeline_file", "hub": "pipeline_hub"}
EVAL_NAME = "pipeline_eval"  # the held-out file's (eval_file)
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
LINES_CHECKED = 5
TEXT_BYTES_CHECKED = 1 << 16
# How far the check reads for its first lines: a "line" longer than this is no training document
# (and a file without newlines is not read to its end).
LINE_BYTES_CHECKED = 16 << 20


HUB_COPIES = "hub"  # data/hub/<org>--<name>.jsonl: a Hub dataset's split as the data stage wrote it
CHAT = "chat"
CHAT_FILE = "chat.jsonl"  # beside the model's data/train.jsonl
CHAT_EVAL_FILE = "chat_eval.jsonl"  # its held-out conversations (eval loss; never trained on)


@dataclass(frozen=True)
class DataSource:
    kind: str  # file | hub | titan
    dataset: str  # DATASET as given
    file: str | None = None  # kind file: the absolute path read
    format: str = "text"  # text | chat (a .jsonl file of conversations)

    @property
    def loader_name(self) -> str:
        """The dataset name torchtitan's HuggingFaceTextDataLoader is given."""
        return REGISTERED_NAME.get(self.kind, self.dataset)


def resolve(dataset: str, local_file: Path, check_local: bool = True, model: str = "…") -> DataSource:
    """DATASET → a DataSource, refused in one line when it cannot be read. `local_file` is the
    model's data/train.jsonl; a dry run passes check_local=False (it may run before `make data`)."""
    if dataset in (LOCAL, CHAT):
        file = Path(local_file) if dataset == LOCAL else Path(local_file).with_name(CHAT_FILE)
        form = "text" if dataset == LOCAL else "chat"
        if check_local:
            if not file.exists():
                raise PipelineError(f"{file} does not exist (DATASET={dataset}).",
                                    f"run `make data MODEL={model}` first, or give DATASET=<file or dataset id>.")
            form = check_file(file)
        return DataSource("file", dataset, str(file), form)
    if dataset in api.titan_datasets():
        _check_titan_dataset(dataset)
        return DataSource("titan", dataset)
    path = Path(dataset).expanduser()
    if path.is_dir() and hub_copy(Path(local_file).parent, dataset).exists():  # a local dataset directory, copied
        copy = hub_copy(Path(local_file).parent, dataset)
        return DataSource("file", dataset, str(copy), check_file(copy))
    if path.suffix in FILE_FORMATS or path.exists() or dataset.startswith(("/", ".", "~")):
        form = check_file(path)
        return DataSource("file", dataset, str(path.resolve()), form)
    if HUB_ID.fullmatch(dataset):
        copy = hub_copy(Path(local_file).parent, dataset)
        if copy.exists():  # a split the data stage copied, columns renamed: read like any file
            return DataSource("file", dataset, str(copy), check_file(copy))
        return DataSource("hub", dataset)
    raise PipelineError(f"DATASET={dataset!r} is not {LOCAL!r}, a .jsonl/.txt file, a torchtitan dataset "
                        f"({', '.join(api.titan_datasets())}) or a Hub dataset id (org/name).",
                        "check the spelling, or give the path of an existing file.")


def hub_copy(data_dir: Path, dataset: str) -> Path:
    """Where the data stage writes a Hub dataset's split (its record beside it, .json); a local dataset
    directory's copy is named by the directory."""
    name = dataset.replace("/", "--") if HUB_ID.fullmatch(dataset) else Path(dataset).expanduser().resolve().name
    return Path(data_dir) / HUB_COPIES / f"{name}.jsonl"


def check_file(path: Path) -> str:
    """The file exists, is readable, and its first lines are what the loader expects; returns its
    format (text, or chat for JSON lines of conversations)."""
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
            head = handle.read(TEXT_BYTES_CHECKED)
            if FILE_FORMATS[path.suffix] == "json":
                lines = _first_lines(handle, head)
    except FileNotFoundError as err:
        raise PipelineError(f"{where} does not exist.", "check the path.") from err
    except PermissionError as err:
        raise PipelineError(f"{where} is not readable ({err.strerror}).", "fix its permissions.") from err
    if not head.strip():
        raise PipelineError(f"{where} is empty.", "give a file with training text.")
    if FILE_FORMATS[path.suffix] == "text":
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as err:
            if err.start < len(head) - 3:  # not just a character cut at the end of the sample
                raise PipelineError(f"{where} is not UTF-8 text (byte {err.start}).", "save it as UTF-8.") from err
        return "text"
    form = None
    for number, line in lines:
        form = check_record(line, where, number, form)
    return form or "text"


def check_record(line: str, where: str, number: int, form: str | None = None) -> str:
    """One JSON line against the file's format (None: this line decides it); returns the format."""
    from pipeline.training import chat

    try:
        record = json.loads(line)
    except json.JSONDecodeError as err:
        raise PipelineError(f"{where}:{number} is not JSON ({err.msg}).",
                            "write one JSON object per line, e.g. {\"text\": \"…\"}.") from err
    if form is None:
        form = "chat" if isinstance(record, dict) and chat.is_chat_record(record) else "text"
    if form == "chat":
        problem = chat.conversation_problem(record)
        if problem:
            raise PipelineError(f"{where}:{number} {problem} (the file is chat data: its first record has "
                                "\"messages\" or \"prompt\"/\"completion\").",
                                "give every line {\"messages\": [{\"role\": \"user\", \"content\": …}, "
                                "{\"role\": \"assistant\", \"content\": …}]} or {\"prompt\": …, \"completion\": …}.")
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
    if source.kind == "file":
        path = Path(source.file)
        check_file(path)
        where = f"DATASET file {path}"
        with open(path, "rb") as handle:
            if FILE_FORMATS[path.suffix] == "text":
                decoder = codecs.getincrementaldecoder("utf-8")()
                read = 0
                try:
                    for block in iter(lambda: handle.read(1 << 20), b""):
                        decoder.decode(block)
                        read += len(block)
                    decoder.decode(b"", final=True)
                except UnicodeDecodeError as err:
                    raise PipelineError(f"{where} is not UTF-8 text (byte {read + err.start}).", "save it as UTF-8.") from err
                return
            form = None
            for number, raw in enumerate(handle, 1):
                if raw.strip():
                    form = check_record(raw.decode("utf-8", errors="replace"), where, number, form)
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


def _first_lines(handle, head: bytes) -> list[tuple[int, str]]:
    """The first LINES_CHECKED non-empty complete lines as (number, text), reading past `head` only
    as far as needed to complete them."""
    data, at_end = head, False
    while True:
        *complete, rest = data.split(b"\n")  # `rest` follows the last newline: partial unless at the end
        if at_end and rest.strip():
            complete.append(rest)
        lines = [(number, line) for number, line in enumerate(complete, 1) if line.strip()]
        if len(lines) >= LINES_CHECKED or at_end:
            return [(number, line.decode("utf-8", errors="replace")) for number, line in lines[:LINES_CHECKED]]
        if len(data) > LINE_BYTES_CHECKED:
            raise PipelineError(f"DATASET file {handle.name}: its first {LINES_CHECKED} lines take more than "
                                f"{LINE_BYTES_CHECKED >> 20} MiB; JSON lines hold one document per line.",
                                "write one JSON object per line, e.g. {\"text\": \"…\"}.")
        more = handle.read(TEXT_BYTES_CHECKED)
        at_end = not more
        data += more


def _check_titan_dataset(name: str) -> None:
    path = api.titan_datasets()[name]
    # c4_test reads a path relative to the working directory (a torchtitan source checkout's
    # tests/assets), which the wheel does not ship; the others are Hub datasets.
    if not HUB_ID.fullmatch(path) and not Path(path).exists():
        raise PipelineError(f"DATASET={name} reads {path} relative to the working directory (a torchtitan "
                            f"source checkout), and {Path(path).resolve()} does not exist.",
                            "run from a torchtitan checkout, or give DATASET=<file>.")


def register(source: DataSource, name: str | None = None) -> str:
    """In a rank: add a file or Hub dataset to torchtitan's registry (under `name`, default the
    kind's registered name); returns the loader's name."""
    if source.kind == "titan" or source.format == "chat":  # chat: training.chat's own loader reads the file
        return source.loader_name
    from pipeline.titan import api

    if source.kind == "file":
        api.register_text_dataset(name or source.loader_name, "file", source.file,
                                  FILE_FORMATS[Path(source.file).suffix],
                                  wrap_loader=lambda loader: _one_line_errors(loader, source))
    else:
        api.register_text_dataset(name or source.loader_name, "hub", source.dataset, None,
                                  wrap_loader=lambda loader: _one_line_errors(loader, source))
    return name or source.loader_name


def open_in_rank(source: DataSource) -> None:
    """In a rank, before torchtitan's Trainer is built: open a file dataset as its loader will (the
    datasets cache makes the loader's own open cheap). An error here is the rank's one line; inside
    the Trainer's constructor torchrun's error record would add a traceback per rank."""
    if source.kind != "file":
        return
    from datasets import load_dataset

    builder = "json" if FILE_FORMATS[Path(source.file).suffix] == "json" else "text"
    extra = {"sample_by": "paragraph"} if builder == "text" else {}
    _one_line_errors(lambda path: load_dataset(builder, data_files=path, split="train", **extra), source)(source.file)


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
        if data.dataset != CHAT:
            return None
        held = Path(local_file).with_name(CHAT_EVAL_FILE)
        if check_local and not held.exists():
            raise PipelineError(f"{held} does not exist (the held-out split of DATASET=chat).",
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
