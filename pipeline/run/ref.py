"""The run address, declared once: which model (MODEL), which training path (TRAIN_PATH), which run
(RUN_NAME). Every stage that names a model or a run takes these flags from RunRef (pipeline.flags), so
`--name` means the run's name wherever it is accepted, never an abbreviation of another flag."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pipeline.flags import flag
from pipeline.run import store
from pipeline.run.rundir import RunDir


@dataclass(frozen=True)
class RunRef:
    model: str = flag(None, "Hub id, local HF directory, or tiny / tiny-moe", required=True)
    path: str = flag(None, "training path", required=True)
    name: str | None = flag(None, "the run's name, its folder runs/<name> (RUN_NAME; default: the path's name); a "
                            "re-run continues it only with the same settings")

    @property
    def run_name(self) -> str:
        return self.path if self.name is None else self.name  # an empty name is a value: store refuses it

    def run_dir(self, root: Path | None = None) -> RunDir:
        """checkpoints/<key>/runs/<name> under `root` (default: this host's checkpoints root)."""
        return store.home(self.model, root).run(self.run_name)
