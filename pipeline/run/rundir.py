"""One run directory, checkpoints/<model>/runs/<path>/: every file a run holds, named once.

  run.json               the resolved run (RunSpec)          metrics.jsonl   one JSON object per step
  first_batch/rank*.safetensors   each rank's step-1 batch    timings.json    start-up marks of rank 0
  checkpoint/step-N/     torchtitan DCP + model_weights.safetensors (the complete-checkpoint mark)
  export/                the HF export                        verify.json     verify's result
  logs/, tb/             per-rank logs, TensorBoard events    .lock           held by a live launch
  plan/rank*.json        what each rank ran (parallel layout, step 1), when the run records it (rehearse)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
FIRST_BATCH = "first_batch"
TIMINGS = "timings.json"
CHECKPOINT = "checkpoint"
# Beside each DCP step: the full model state dict as safetensors (torchtitan keys). DCP's own
# .metadata is a pickle, and this project never unpickles a checkpoint; export reads this file.
# It is renamed into place after DCP finished the step, so a step that has it is complete.
WEIGHTS = "model_weights.safetensors"
DCP_METADATA = ".metadata"
EXPORT = "export"
VERIFY = "verify.json"
LOGS = "logs"
TENSORBOARD = "tb"
LOCK = ".lock"
PLAN = "plan"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_json(self) -> Path:
        return self.path / RUN_JSON

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def first_batch(self) -> Path:
        return self.path / FIRST_BATCH

    @property
    def timings(self) -> Path:
        return self.path / TIMINGS

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def export(self) -> Path:
        return self.path / EXPORT

    @property
    def verify(self) -> Path:
        return self.path / VERIFY

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def plan(self) -> Path:
        return self.path / PLAN

    def plan_records(self) -> list[dict]:
        """Every rank's plan/rank<N>.json, in rank order."""
        files = sorted(self.plan.glob("rank*.json"), key=lambda f: int(f.stem.removeprefix("rank")))
        return [json.loads(f.read_text()) for f in files]

    def exists(self) -> bool:
        return self.run_json.is_file()

    def spec(self):
        """The run's RunSpec, or a one-line error when there is no run here."""
        from pipeline.run.spec import RunSpec

        if not self.run_json.exists():
            raise PipelineError(f"{self.run_json} does not exist: no run there.",
                                "train first, e.g. `make train-native MODEL=tiny`.")
        return RunSpec.load(self.run_json)

    # ---- checkpoints ------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.checkpoint / f"step-{step}"

    def checkpoint_steps(self) -> dict[int, Path]:
        found = {}
        if self.checkpoint.is_dir():
            for item in self.checkpoint.iterdir():
                match = re.fullmatch(r"step-(\d+)", item.name)
                if match and item.is_dir():
                    found[int(match.group(1))] = item
        return found

    def dcp_steps(self) -> list[int]:
        """Steps whose DCP save finished (torchtitan resumes from the last of these)."""
        return sorted(s for s, d in self.checkpoint_steps().items() if (d / DCP_METADATA).exists())

    def complete_steps(self) -> list[int]:
        """Steps with the weights file, renamed into place last: complete checkpoints."""
        return sorted(s for s, d in self.checkpoint_steps().items() if (d / WEIGHTS).exists())

    def latest_complete_step(self) -> int | None:
        steps = self.complete_steps()
        return steps[-1] if steps else None

    def weights_file(self, step: int | None = None) -> tuple[int, Path]:
        """The safetensors weights of the last complete (or the given) checkpoint."""
        steps = self.checkpoint_steps()
        if not steps:
            raise PipelineError(f"{self.path} has no checkpoint yet.",
                                "train first (`make train-… STEPS=N`; STEPS=0 saves the loaded weights).")
        if step is None:
            # A save cut short by a kill lacks the weights file and is skipped, as torchtitan's resume skips it.
            step = self.latest_complete_step()
            if step is None:
                step = max(steps)
        elif step not in steps:
            raise PipelineError(f"{self.path} has no checkpoint of step {step} (it has {sorted(steps)}).",
                                "pick one of those steps.")
        path = steps[step] / WEIGHTS
        if not path.exists():
            raise PipelineError(f"{steps[step]} has no {WEIGHTS} (interrupted save, or made by another trainer).",
                                "resume or rerun the training stage so the checkpoint is written completely.")
        return step, path

    # ---- metrics ----------------------------------------------------------------------------

    def metric_records(self, warnings: list[str] | None = None) -> list[dict]:
        """metrics.jsonl by step (a repeated step keeps its latest line); torn or foreign lines
        are skipped, and named in `warnings` when given."""
        if not self.metrics.is_file():
            return []
        by_step: dict[int, dict] = {}
        for number, line in enumerate(self.metrics.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if warnings is not None:
                    warnings.append(f"{self.metrics}:{number} is not JSON; line skipped.")
                continue
            if not isinstance(record, dict) or any(not isinstance(record.get(k), (int, float)) for k in ("step", "loss")):
                if warnings is not None:
                    warnings.append(f"{self.metrics}:{number} lacks a numeric step or loss; line skipped.")
                continue
            record["step"] = int(record["step"])
            by_step[record["step"]] = record
        return [by_step[s] for s in sorted(by_step)]

    def step1_loss(self) -> float | None:
        """The logged step-1 loss, or None when step 1 was not logged."""
        return next((float(r["loss"]) for r in self.metric_records() if r["step"] == 1), None)

    def first_batches(self) -> list[dict]:
        from safetensors.torch import load_file

        files = sorted(self.first_batch.glob("rank*.safetensors"))
        if not files:
            raise PipelineError(f"{self.first_batch} holds no recorded batch.",
                                "run the training stage (STEPS ≥ 1 records it) before checking the step-1 loss.")
        return [load_file(str(f)) for f in files]
