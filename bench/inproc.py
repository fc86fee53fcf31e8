"""In-process timings for `make bench`: each measured call runs after its process has imported what
it needs, so neither side of a ratio pays interpreter start-up or imports. Prints one JSON line.

  inproc.py export <model> <path> <dtype>
      the export stage's export() (forced), then shutil.copyfile of the same shard bytes (what
      `cp` does) into a scratch directory beside it, in the same process
  inproc.py verify <model> <path>
      the verify stage's verify() of the run's export
  inproc.py plain <export dir> <run dir>
      transformers' from_pretrained of the export plus one forward over the run's first batch (the
      step-1 loss, as verify computes it): the baseline verify is compared with

Peak RSS: the process's ru_maxrss after the call, and before it (imports done, nothing loaded).
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path


def rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def export(model: str, path: str, dtype: str) -> dict:
    import huggingface_hub  # noqa: F401 - imported before timing, as the stage imports it lazily
    import torch  # noqa: F401
    import transformers  # noqa: F401

    from pipeline.models import registry
    from pipeline.run import store
    from pipeline.outputs import export as stage

    run = store.home(model).run(path)
    registry.get(path).build(run.spec())  # torchtitan's model spec imported (the export builds it)
    before = rss_gib()
    # Both sides start with no dirty pages waiting for the disk: the kernel throttles a writer by
    # the backlog, whoever left it.
    os.sync()
    start = time.perf_counter()
    target = stage.export(stage.ExportConfig(run=run, dtype=dtype, force=True))
    export_s = time.perf_counter() - start
    after = rss_gib()
    shards = sorted(target.glob("*.safetensors"))
    size = sum(p.stat().st_size for p in shards)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        os.sync()
        start = time.perf_counter()
        for shard in shards:
            shutil.copyfile(shard, Path(scratch) / shard.name)
        cp_s = time.perf_counter() - start
    largest = max(_tensor_bytes(shards))
    return {"export_s": export_s, "cp_s": cp_s, "bytes": size, "shards": len(shards), "largest_tensor_bytes": largest,
            "rss_before_gib": before, "rss_peak_gib": after}


def _tensor_bytes(shards: list[Path]):
    import torch

    from pipeline.checkpoint import hf_dir
    from pipeline.dtypes import SAFETENSORS_NAMES

    for shard in shards:
        for info in hf_dir.read_header(shard).values():
            count = 1
            for d in info.shape:
                count *= d
            yield count * getattr(torch, SAFETENSORS_NAMES[info.dtype]).itemsize


def verify(model: str, path: str) -> dict:
    import torch  # noqa: F401
    import transformers

    from pipeline.run import store
    from pipeline.outputs import verify as stage

    transformers.utils.logging.disable_progress_bar()
    run = store.home(model).run(path)
    before = rss_gib()
    start = time.perf_counter()
    result = stage.verify(run.export, Path(run.spec().source_dir), run, run.verify)
    verify_s = time.perf_counter() - start
    origin = next((c.detail for c in result.checks if c.name == "step1-loss-source"), "")
    return {"verify_s": verify_s, "passed": result.passed, "rss_before_gib": before, "rss_peak_gib": rss_gib(),
            "source_loss_cached": "earlier verify" in origin}


def plain(export_dir: str, run_dir: str) -> dict:
    import torch
    import transformers

    from pipeline.checkpoint.reference_loss import step1_loss
    from pipeline.run.rundir import RunDir

    transformers.utils.logging.disable_progress_bar()
    batches = RunDir(Path(run_dir)).first_batches()
    before = rss_gib()
    start = time.perf_counter()
    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, dtype=torch.float32).eval()
    loaded = time.perf_counter() - start
    loss = step1_loss(model, batches)
    total = time.perf_counter() - start
    return {"plain_s": total, "from_pretrained_s": loaded, "forward_s": total - loaded, "loss": loss,
            "rss_before_gib": before, "rss_peak_gib": rss_gib()}


if __name__ == "__main__":
    command, *args = sys.argv[1:]
    print(json.dumps({"export": export, "verify": verify, "plain": plain}[command](*args)))
