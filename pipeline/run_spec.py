"""The fully resolved description of one training run, written to `<run_dir>/run.json`.

The `train` stage resolves configs, flags and the checkpoint into a RunSpec; every torchrun
rank reads the same file. A dry run prints it. No torch imports here.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from pipeline.fsutil import atomic_write_text


@dataclass
class RunSpec:
    model_name: str
    path: str  # training path: hf | native | nki
    target: str  # cpu | cuda | trn2
    hf_dir: str
    run_dir: str
    arch: dict
    steps: int
    seq_len: int
    local_batch_size: int
    lr: float
    warmup_steps: int
    max_norm: float
    dtype: str
    seed: int
    nproc_per_node: int
    nnodes: int = 1
    tensor_parallel: int = 1
    data_parallel_shard: int = -1
    sequence_parallel: bool = False
    activation_checkpoint: str = "none"
    compile: bool = False
    compile_backend: str = "inductor"
    checkpoint_interval: int = 10
    keep_latest_k: int = 2
    dataset: str = "local"
    data_file: str | None = None
    tensorboard: bool = True
    peak_flops_per_rank: float | None = None
    overrides: list = field(default_factory=list)
    nki: dict = field(default_factory=dict)

    def save(self) -> Path:
        path = Path(self.run_dir) / "run.json"
        atomic_write_text(path, json.dumps(asdict(self), indent=2) + "\n")
        return path

    @classmethod
    def load(cls, path: str | Path) -> "RunSpec":
        data = json.loads(Path(path).read_text())
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)
