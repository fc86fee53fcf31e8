"""One torchrun rank of bench/memory_estimate.py: pipeline.training.entry, plus the process's resident
set right after the trainer is built (model and optimizer allocated, nothing trained) and its peak."""

from __future__ import annotations

import json
import os
import resource
import sys
from pathlib import Path

from pipeline.run.spec import RunSpec
from pipeline.titan import patches


def _rss_now() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def main() -> None:
    spec = RunSpec.load(sys.argv[1])
    patches.apply(spec.target)
    from pipeline.titan.trainer import PipelineTrainer
    from pipeline.training import entry

    train = PipelineTrainer.train
    marks = {}

    def measured_train(self):
        marks["rss_built"] = _rss_now()
        marks["params_bytes"] = sum(p.to_local().numel() * p.element_size() if hasattr(p, "to_local")
                                    else p.numel() * p.element_size() for p in self.model_parts[0].parameters())
        try:
            return train(self)
        finally:
            marks["rss_peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            rank = int(os.environ.get("RANK", "0"))
            (Path(spec.run_dir) / f"memory-rank{rank}.json").write_text(json.dumps(marks) + "\n")

    PipelineTrainer.train = measured_train
    entry.main([sys.argv[1]])


if __name__ == "__main__":
    main()
