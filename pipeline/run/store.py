"""Where a model's files live: checkpoints/<key>/{source.json, source/, data/, runs/<path>/, report/, rehearse/}.

The key is the full source, so two sources never share a folder: an embedded name (`tiny`), a
Hub id (`Qwen/Qwen3-0.6B` → `Qwen--Qwen3-0.6B`), or a local directory (`local--<name>-<8 hex of
its absolute path>`). A bare name with a config.json in configs/hub_configs (`Qwen3-MoE-trn2-fit`)
is an architecture without weights: dry runs resolve it, nothing downloads or trains it. `source.json` records what was downloaded; later stages check it against
MODEL and REVISION. Hub weights stay in the Hugging Face cache (HF_HOME), shared with other HF
tools; embedded and local sources are written to `source/`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.run.rundir import RunDir
from pipeline.run.settings import CONFIG_DIR

REPO = Path(__file__).resolve().parent.parent.parent
EMBEDDED_NAMES = ("tiny", "tiny-moe")
SOURCE_RECORD = "source.json"
HUB_CONFIGS = CONFIG_DIR / "hub_configs"  # real (and trn2-shaped) config.json files, for dry runs
# Written into every checkpoints root the pipeline writes to: `make clean` / `distclean` delete only
# under a directory that carries it (the Makefile's ROOT_MARKER names the same file).
ROOT_MARKER = ".pipeline-checkpoints"


def checkpoints_root() -> Path:
    return Path(os.environ.get(envvars.CHECKPOINTS, REPO / "checkpoints"))


def mark_root(root: Path | None = None) -> None:
    """Create the checkpoints root if needed and mark it as the pipeline's (what clean checks)."""
    root = Path(root) if root else checkpoints_root()
    root.mkdir(parents=True, exist_ok=True)
    marker = root / ROOT_MARKER
    if not marker.exists():
        atomic_write_text(marker, "A checkpoints root of the pipeline: `make clean` / `make distclean` delete only "
                                  "under a directory carrying this file.\n")


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
        return json.loads(self.source_record.read_text())

    def write_record(self, **fields) -> None:
        mark_root(self.root)
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
