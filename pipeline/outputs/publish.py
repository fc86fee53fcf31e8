"""What `make publish` asks for: which Hub repository a run's verified export (or its adapters) goes to, and
how. The upload itself is the `publish` stage's (pipeline/stages/publish.py); this request lives here, below
the stages, so that the Make interface (pipeline.host.makevars) is generated from its fields too."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.flags import flag


@dataclass(frozen=True)
class PublishRequest:
    """Its fields are the `publish` stage's flags (pipeline.flags) and Make variables (pipeline.host.makevars);
    the run is RunRef's."""

    repo: str = flag(None, "Hub repository id, <user or org>/<name>", required=True, make="HUB_REPO",
                     make_help="publish: the Hub model repository (<user or org>/<name>) a run's verified export is "
                     "uploaded to")
    public: bool = flag(False, "create the repository public (default: private)", make="PUBLIC",
                        make_help="publish: 1 creates the repository public (default private)")
    dry_run: bool = flag(False, "list what would be uploaded; no network", make="DRY_RUN")
    adapter: bool = flag(False, "a LoRA run's adapters (<run dir>/export-adapter) instead, those of its verified "
                         "export's step", make="ADAPTER")
