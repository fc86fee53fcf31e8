"""The fully resolved description of one training run, written to `<run dir>/run.json`.

`training.resolve` makes it from settings, flags and the checkpoint; every torchrun rank reads the
same file; export, verify and report read it back. It holds the settings as they are
(`TrainSettings`) and the architecture as it is (`Qwen3Arch`), never copies of their fields.
No torch imports here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pipeline.checkpoint.arch import Qwen3Arch
from pipeline.run import settings as settings_mod
from pipeline.run.settings import TrainSettings


@dataclass
class RunSpec:
    model: str  # MODEL as given: embedded name, Hub id or directory
    model_key: str  # its folder under checkpoints/
    path: str  # training path (pipeline.models.registry)
    target: str  # cpu | cuda | trn2
    source_dir: str  # the HF checkpoint the run starts from
    run_dir: str
    arch: Qwen3Arch
    settings: TrainSettings
    # settings.dataset (DATASET=) resolved: file | titan | hub, and the file read for kind file
    # (pipeline.data.dataset)
    data_kind: str = "file"
    data_file: str | None = None
    data_format: str = "text"  # text | chat (conversations, loss on assistant tokens: pipeline.data.chat)
    eval_file: str | None = None  # the held-out file eval loss is computed on (settings.eval_every > 0), or None
    peak_flops_per_rank: float | None = None
    overrides: list = field(default_factory=list)  # torchtitan override.imports entries
    titan_args: list = field(default_factory=list)  # torchtitan CLI flags applied over the built config
    nki: dict = field(default_factory=dict)  # the nki path's plan (overrides, kernels, constraints)
    memory: dict = field(default_factory=dict)  # training.memory's estimate of device memory per rank
    record_plan: bool = False  # every rank writes plan/rank<N>.json (layout, step 1); the rehearsal sets it

    @property
    def world_size(self) -> int:
        return self.settings.world_size

    def to_dict(self) -> dict:
        data = asdict(self)
        data["arch"] = self.arch.to_dict()
        data["settings"] = settings_mod.to_dict(self.settings)
        return data

    def to_json(self) -> str:
        """run.json's text (pipeline.run.rundir reads and writes the file)."""
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: dict) -> "RunSpec":
        data = dict(data)
        data["arch"] = Qwen3Arch(**data["arch"])
        data["settings"] = settings_mod.from_dict(data["settings"])
        known = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> "RunSpec":
        """run.json, refused in one line when it is not a regular file, torn or not a run's record."""
        from pipeline.errors import PipelineError
        from pipeline.fsutil import read_json_object

        fix = "start the run again with FRESH=1 (its files are not a run this pipeline can read), or give another RUN_NAME."
        data = read_json_object(Path(path), fix)
        try:
            return cls.from_dict(data)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            raise PipelineError(f"{path} is not a run's record ({type(err).__name__}: {err}).", fix) from err
