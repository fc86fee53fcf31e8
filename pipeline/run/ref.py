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
    model: str = flag(None, "Hub id (org/name), a local HF directory, or tiny / tiny-moe (embedded)", required=True,
                      make="MODEL", make_default="$(MODEL)")
    path: str = flag(None, "training path (`python -m pipeline paths` lists them)", required=True, make="TRAIN_PATH",
                     make_default="$(TRAIN_PATH)")
    name: str | None = flag(None, "the run's name, its folder runs/<name> (default: the path's name); a re-run "
                            "continues it only with the same settings", make="RUN_NAME", make_default="TRAIN_PATH")

    @property
    def run_name(self) -> str:
        return self.path if self.name is None else self.name  # an empty name is a value: store refuses it

    def run_dir(self, root: Path | None = None) -> RunDir:
        """checkpoints/<key>/runs/<name> under `root` (default: this host's checkpoints root)."""
        return store.home(self.model, root).run(self.run_name)
