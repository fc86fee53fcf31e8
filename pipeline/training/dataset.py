"""DATASET: what a run trains on. Checked in the launcher before any rank starts; registered in
each rank with torchtitan's dataset registry (so torchtitan's own HF text loader reads it).

  local             the model's data/train.jsonl (written by `make data`)
  a .jsonl file     JSON lines, each an object with a "text" string
  a .txt file       plain UTF-8 text, one document per paragraph (blank-line separated)
  c4, c4_test, …    a torchtitan dataset (titan.api.titan_datasets()); C4 is trn2's default
  org/name          a Hub dataset with a "text" column, streamed (split "train")
"""

from __future__ import annotations

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
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")
LINES_CHECKED = 5
TEXT_BYTES_CHECKED = 1 << 16


@dataclass(frozen=True)
class DataSource:
    kind: str  # file | hub | titan
    dataset: str  # DATASET as given
    file: str | None = None  # kind file: the absolute path read

    @property
    def loader_name(self) -> str:
        """The dataset name torchtitan's HuggingFaceTextDataLoader is given."""
        return REGISTERED_NAME.get(self.kind, self.dataset)


def resolve(dataset: str, local_file: Path, check_local: bool = True, model: str = "…") -> DataSource:
    """DATASET → a DataSource, refused in one line when it cannot be read. `local_file` is the
    model's data/train.jsonl; a dry run passes check_local=False (it may run before `make data`)."""
    if dataset == LOCAL:
        if check_local:
            if not Path(local_file).exists():
                raise PipelineError(f"{local_file} does not exist (DATASET=local).",
                                    f"run `make data MODEL={model}` first, or give DATASET=<file or dataset id>.")
            check_file(Path(local_file))
        return DataSource("file", dataset, str(local_file))
    if dataset in api.titan_datasets():
        _check_titan_dataset(dataset)
        return DataSource("titan", dataset)
    path = Path(dataset).expanduser()
    if path.suffix in FILE_FORMATS or path.exists() or dataset.startswith(("/", ".", "~")):
        check_file(path)
        return DataSource("file", dataset, str(path.resolve()))
    if HUB_ID.fullmatch(dataset):
        return DataSource("hub", dataset)
    raise PipelineError(f"DATASET={dataset!r} is not {LOCAL!r}, a .jsonl/.txt file, a torchtitan dataset "
                        f"({', '.join(api.titan_datasets())}) or a Hub dataset id (org/name).",
                        "check the spelling, or give the path of an existing file.")


def check_file(path: Path) -> None:
    """The file exists, is readable, and its first lines are what the loader expects."""
    where = f"DATASET file {path}"
    if path.is_dir():
        raise PipelineError(f"{where} is a directory.", "give a .jsonl or .txt file.")
    if path.suffix not in FILE_FORMATS:
        raise PipelineError(f"{where} has suffix {path.suffix!r}; only {', '.join(FILE_FORMATS)} are read.",
                            "convert it to JSON lines with a \"text\" field, or to plain text.")
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
        return
    for number, line in lines:
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise PipelineError(f"{where}:{number} is not JSON ({err.msg}).",
                                "write one JSON object per line, e.g. {\"text\": \"…\"}.") from err
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise PipelineError(f"{where}:{number} has no \"text\" string (keys: "
                                f"{sorted(record) if isinstance(record, dict) else type(record).__name__}).",
                                "give every line a \"text\" field holding the document.")


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


def register(source: DataSource) -> str:
    """In a rank: add a file or Hub dataset to torchtitan's registry; returns the loader's name."""
    if source.kind == "titan":
        return source.loader_name
    from pipeline.titan import api

    if source.kind == "file":
        api.register_text_dataset(source.loader_name, "file", source.file, FILE_FORMATS[Path(source.file).suffix])
    else:
        api.register_text_dataset(source.loader_name, "hub", source.dataset, None)
    return source.loader_name
