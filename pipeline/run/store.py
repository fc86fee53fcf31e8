"""Where a model's files live: checkpoints/<key>/{source.json, source/, data/, runs/<path>/, report/, rehearse/}.

The key is the full source, so two sources never share a folder: an embedded name (`tiny`), a
Hub id (`Qwen/Qwen3-0.6B` → `Qwen--Qwen3-0.6B`), or a local directory (`local--<name>-<8 hex of
its absolute path>`). A bare name with a config.json in configs/hub_configs (`Qwen3-MoE-trn2-fit`)
is an architecture without weights: dry runs resolve it, nothing downloads or trains it. `source.json` records what was downloaded; later stages check it against
MODEL and REVISION. Hub weights stay in the Hugging Face cache (HF_HOME), shared with other HF
tools; embedded and local sources are written to `source/`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text, read_json_object, read_small_text
from pipeline.run.rundir import RunDir
from pipeline.run.settings import CONFIG_DIR

REPO = Path(__file__).resolve().parent.parent.parent
EMBEDDED_NAMES = ("tiny", "tiny-moe")
SOURCE_RECORD = "source.json"
HUB_CONFIGS = CONFIG_DIR / "hub_configs"  # real (and trn2-shaped) config.json files, for dry runs
# Written into a checkpoints root the pipeline made (new, or empty when it first wrote there), with the
# model keys it made in it, one a line: `make clean` / `distclean` act only in a root carrying it (a
# regular file, not a link) and delete only those keys' files (the Makefile's ROOT_MARKER names the same file).
ROOT_MARKER = ".pipeline-checkpoints"
MARKER_HEADER = ("# A checkpoints root of the pipeline: `make clean` / `make distclean` act only in a directory carrying\n"
                 "# this file, and delete only the model folders listed below (the ones the pipeline made here).\n")
KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,199}")


def checkpoints_root() -> Path:
    return Path(os.environ.get(envvars.CHECKPOINTS, REPO / "checkpoints"))


def is_marked(root: Path) -> bool:
    """The root carries the marker as a regular file of its own (a link to one is no marker)."""
    try:
        return stat.S_ISREG(os.lstat(Path(root) / ROOT_MARKER).st_mode)
    except OSError:
        return False


def mark_root(root: Path | None = None, key: str | None = None) -> None:
    """Create the checkpoints root if needed; mark it as the pipeline's only when the pipeline made it
    (new, empty, or the repository's own checkpoints/): a folder of yours holding other projects is
    written to, never armed for clean. In a marked root, record `key` as a model folder the pipeline made."""
    root = Path(root) if root else checkpoints_root()
    made_here = not root.exists() or root.resolve() == (REPO / "checkpoints").resolve()
    root.mkdir(parents=True, exist_ok=True)
    if not is_marked(root):
        if not made_here and any(root.iterdir()):
            return
        atomic_write_text(root / ROOT_MARKER, MARKER_HEADER)
    if key and KEY.fullmatch(key) and key not in marked_keys(root):
        # one short O_APPEND write: two stages recording keys at once both keep theirs; O_NOFOLLOW: never a link
        fd = os.open(root / ROOT_MARKER, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW)
        try:
            os.write(fd, f"{key}\n".encode())
        finally:
            os.close(fd)


def marked_keys(root: Path) -> list[str]:
    """The model keys the marker lists (an older marker lists none)."""
    if not is_marked(root):
        return []
    lines = read_small_text(Path(root) / ROOT_MARKER, fix="delete it and run a stage again.").splitlines()
    return list(dict.fromkeys(line.strip() for line in lines if KEY.fullmatch(line.strip())))


def pipeline_keys(root: Path) -> list[str]:
    """The model folders of `root` the pipeline made: listed in the marker, or (a root marked before keys
    were listed) holding a source.json that records the model this key is."""
    root = Path(root)
    keys = [k for k in marked_keys(root) if (root / k).is_dir() and not (root / k).is_symlink()]
    for entry in sorted(root.iterdir()) if root.is_dir() else []:
        if entry.name in keys or entry.is_symlink() or not entry.is_dir():
            continue
        with contextlib.suppress(OSError, ValueError, PipelineError, AttributeError, TypeError):
            record = read_json_object(entry / SOURCE_RECORD, "none: not the pipeline's folder.")
            if record.get("kind") in ("embedded", "hub") and parse_model(record["model"]).key == entry.name:
                keys.append(entry.name)
    return keys


@dataclass(frozen=True)
class Source:
    """MODEL, classified: `embedded` (made here), `hub` (org/name), `local` (a directory) or
    `config` (a configs/hub_configs name: dry runs only)."""

    kind: str
    model: str
    key: str
    repo_id: str | None = None
    path: str | None = None

    @property
    def name(self) -> str:
        """The last part of the id (for configs/hub_configs and models.toml look-ups)."""
        return (self.repo_id or self.path or self.model).rstrip("/").rsplit("/", 1)[-1]


def parse_model(model: str) -> Source:
    if model in EMBEDDED_NAMES:
        return Source("embedded", model, model)
    if Path(model).expanduser().is_dir():
        path = Path(model).expanduser().resolve()
        digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
        return Source("local", model, f"local--{path.name}-{digest}", path=str(path))
    if "/" not in model and (HUB_CONFIGS / f"{model}.json").is_file():
        return Source("config", model, model)
    if model.startswith(("/", ".", "~")) or model.count("/") > 1:
        raise PipelineError(f"MODEL={model!r} is not an existing directory (and not a Hub id org/name).",
                            "check the path.")
    org, _, name = model.partition("/")
    if not org or not name or any(c in model for c in " \\:"):
        raise PipelineError(f"MODEL={model!r} is not a Hub id (org/name), an existing directory, or "
                            f"{'/'.join(EMBEDDED_NAMES)}.", "check the spelling or the path.")
    return Source("hub", model, f"{org}--{name}", repo_id=model)


@dataclass(frozen=True)
class ModelHome:
    source: Source
    root: Path

    @property
    def dir(self) -> Path:
        return self.root / self.source.key

    @property
    def source_record(self) -> Path:
        return self.dir / SOURCE_RECORD

    @property
    def local_source(self) -> Path:
        return self.dir / "source"

    @property
    def data_file(self) -> Path:
        return self.dir / "data" / "train.jsonl"

    @property
    def runs(self) -> Path:
        return self.dir / "runs"

    @property
    def report(self) -> Path:
        return self.dir / "report"

    @property
    def launch(self) -> Path:
        return self.dir / "launch"

    @property
    def rehearse(self) -> Path:
        """`make rehearse`: the trn2 plan's runs on CPU, the plain run they are compared with, two-node runs."""
        return self.dir / "rehearse"

    def run(self, name: str) -> RunDir:
        """A run directory, runs/<name> (RUN_NAME; by default the training path's name)."""
        return RunDir(self.runs / check_run_name(name))

    def record(self) -> dict | None:
        if not self.source_record.exists():
            return None
        return read_json_object(self.source_record, f"run `make download MODEL={self.source.model} FORCE=1`.")

    def write_record(self, **fields) -> None:
        mark_root(self.root, self.source.key)
        atomic_write_text(self.source_record, json.dumps({"kind": self.source.kind, "model": self.source.model,
                                                          **fields}, indent=2) + "\n")

    def is_downloaded(self) -> bool:
        return self.record() is not None

    def source_dir(self, revision: str | None = None) -> Path:
        """The downloaded checkpoint directory, checked against what MODEL (and REVISION) ask for."""
        if self.source.kind == "config":
            raise config_only(self.source)
        record = self.record()
        hint = f"make download MODEL={self.source.model}" + (f" REVISION={revision}" if revision else "")
        if record is None:
            raise PipelineError(f"{self.source.model!r} has not been downloaded ({self.source_record} is missing).",
                                f"run `{hint}` first.")
        if record.get("kind") != self.source.kind or record.get("model") not in (self.source.model, None):
            raise PipelineError(f"{self.source_record} records {record.get('kind')} {record.get('model')!r}, "
                                f"not {self.source.kind} {self.source.model!r}.", f"run `{hint}` again.")
        check_revision_applies(self.source, revision)
        if revision and record.get("revision") != revision and record.get("commit") != revision:
            raise PipelineError(f"{self.source.model} was downloaded at revision {record.get('revision')!r}, "
                                f"REVISION={revision!r} was asked for.", f"run `{hint}` first.")
        if self.source.kind != "hub":
            return self.local_source
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError

        try:
            return Path(snapshot_download(self.source.repo_id, revision=record["commit"], local_files_only=True))
        except LocalEntryNotFoundError as err:
            raise PipelineError(f"{self.source.repo_id}@{record['commit']} is no longer in the Hugging Face cache "
                                f"({constants.HF_HUB_CACHE}).",
                                f"run `{hint}` again.") from err


RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


def check_run_name(name: str) -> str:
    """RUN_NAME names one folder under runs/: nothing that leaves it or hides in it."""
    if not RUN_NAME.fullmatch(name or ""):
        raise PipelineError(f"RUN_NAME={name!r} is not a run name (letters, digits, '.', '_' and '-', starting with a "
                            "letter or digit, at most 100 characters).", "pick a name like sft-chat or lora-r8.")
    return name


def config_only(source: Source) -> PipelineError:
    return PipelineError(f"MODEL={source.model!r} is only a config.json in {HUB_CONFIGS} (no weights): it can be "
                         "dry-run, not downloaded or trained.",
                         "add DRY_RUN=1, or give a Hub id (org/name) or a checkpoint directory.")


def check_revision_applies(source: Source, revision: str | None) -> None:
    if revision and source.kind != "hub":
        raise PipelineError(f"REVISION={revision!r} applies to Hub models; {source.model!r} is {source.kind}.",
                            "drop REVISION.")


def home(model: str, root: Path | None = None) -> ModelHome:
    return ModelHome(parse_model(model), Path(root) if root else checkpoints_root())
