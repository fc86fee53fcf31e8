"""verify's checks of an export against the run that made it (not only against its manifest):

  config   config.json's architecture equals run.json's (rope_theta, shapes, tying, MoE fields)
  weights  every tensor equals the model the run saved at the exported step
           (checkpoint/step-N/hf, torchtitan's HF save, cast to the export dtype exactly as
           export does), bitwise; and that save's shards still have the sha256 its ranks recorded
           as they wrote them (step-N/hf/.sha256.json): export links them, so an edit of a linked
           export edits them too, and only the record tells

manifest.json only proves the files are the ones export wrote; an export edited afterwards with a
manifest rewritten to match passes it, and these two checks catch it.
"""

from __future__ import annotations


from pipeline.dtypes import DTYPES
from pipeline.checkpoint import hf_dir
from pipeline.errors import PipelineError
from pipeline.run.rundir import RunDir

EXPORT_DTYPES = {d.safetensors: d.name for d in DTYPES.values()}


def check_config(result, report, run_dir: RunDir) -> None:
    """config.json's architecture (hf_dir.validate parsed it) against run.json's."""
    ours, trained = report.arch.to_dict(), run_dir.spec().arch.to_dict()
    differ = {k: (ours.get(k), trained.get(k)) for k in sorted(set(ours) | set(trained)) if ours.get(k) != trained.get(k)}
    result.add("config", not differ,
               "config.json's architecture equals run.json's" if not differ else
               "config.json differs from run.json: " + ", ".join(f"{k} {a!r} (run: {b!r})" for k, a, b in
                                                                 ((k, *v) for k, v in differ.items())))


def check_weights(result, report, run_dir: RunDir, step: int | None) -> None:
    """Every export tensor bitwise equal to the run's HF save of `step`, cast as export does."""
    from pipeline.checkpoint import stream
    from pipeline.outputs import export as export_stage

    if step is None:
        result.add("weights", False, "manifest.json names no step: the run's weights to compare with are unknown")
        return
    dtypes = {t.dtype for t in report.tensors.values()}
    dtype = EXPORT_DTYPES.get(next(iter(dtypes))) if len(dtypes) == 1 else None
    if dtype is None:
        result.add("weights", False, f"export dtypes {sorted(dtypes)}: export writes one of {sorted(EXPORT_DTYPES)}")
        return
    try:
        saved = export_stage.saved_model(run_dir, step, report.tensors)
    except PipelineError as err:
        result.add("weights", False, f"cannot compare with the run's step-{step} weights: {err.problem}")
        return
    readers = {}
    for shard in [*hf_dir.shard_files(result.checkpoint), *saved.shards]:
        readers[shard] = stream.SafetensorsReader(shard)
    try:
        ours = {key: readers[result.checkpoint / _export_name(saved, info.shard)] for key, info in saved.tensors.items()}
        theirs = {key: readers[saved.directory / info.shard] for key, info in saved.tensors.items()}
        differ = _differing(sorted(saved.tensors), ours, theirs, dtype)
    except (OSError, ValueError, KeyError) as err:
        result.add("weights", False, f"the run's step-{step} weights: {err}")
        return
    finally:
        for reader in readers.values():
            reader.close()
    result.add("weights", not differ,
               f"{len(saved.tensors) - len(differ)}/{len(saved.tensors)} tensors bitwise equal to the run's step-{step} "
               f"weights ({saved.directory.relative_to(run_dir.path)}, {saved.dtype}, cast to {dtype})"
               + (f"; differ: {differ[:3]}" if differ else ""))


def _export_name(saved, shard_name: str) -> str:
    return saved.names()[saved.directory / shard_name]


def _differing(keys: list[str], ours: dict, theirs: dict, dtype: str) -> list[str]:
    import warnings

    import torch

    differ = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a read-only map: only read here
        for key in keys:
            mine, saved = ours[key].view(key), theirs[key].view(key).to(getattr(torch, dtype))
            if mine.shape != saved.shape or not torch.equal(mine.reshape(-1).view(torch.uint8),
                                                            saved.contiguous().reshape(-1).view(torch.uint8)):
                differ.append(key)
    return differ
