"""verify's checks of an export against the run that made it (not only against its manifest):

  config   config.json's architecture equals run.json's (rope_theta, shapes, tying, MoE fields)
  weights  every tensor equals the run's saved weights of the exported step
           (checkpoint/step-N/model_weights.safetensors, converted by the run's own state-dict
           adapter and cast to the export dtype exactly as export does), bitwise

manifest.json only proves the files are the ones export wrote; an export edited afterwards with a
manifest rewritten to match passes it, and these two checks catch it.
"""

from __future__ import annotations

from pathlib import Path

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
    """Every export tensor bitwise equal to the run's saved weights of `step`, converted as export does."""
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
    spec = run_dir.spec()
    try:
        _, weights = run_dir.weights_file(step)
        pieces = export_stage.plan(weights, spec, report.tensors, dtype)
    except PipelineError as err:
        result.add("weights", False, f"cannot compare with the run's step-{step} weights: {err.problem}")
        return
    tied_copy = spec.arch.tie_word_embeddings and any(p.hf_key == export_stage.LM_HEAD for p in pieces)
    convert = export_stage.Converter(weights, spec, dtype, tied_copy)
    readers = {}
    for shard in hf_dir.shard_files(result.checkpoint):
        reader = stream.SafetensorsReader(shard)
        readers |= {key: reader for key in reader.keys()}
    try:
        differ = _differing(pieces, readers, convert)
    except PipelineError as err:
        result.add("weights", False, f"the run's step-{step} weights: {err.problem}")
        return
    finally:
        convert.reader.close()
        for reader in {id(r): r for r in readers.values()}.values():
            reader.close()
    result.add("weights", not differ,
               f"{len(pieces) - len(differ)}/{len(pieces)} tensors bitwise equal to the run's step-{step} weights "
               f"({Path(weights).relative_to(run_dir.path)}, converted to {dtype})"
               + (f"; differ: {differ[:3]}" if differ else ""))


def _differing(pieces, readers: dict, convert) -> list[str]:
    import warnings

    import torch

    differ = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a read-only map: only read here
        for piece in pieces:
            ours, theirs = readers[piece.hf_key].view(piece.hf_key), convert.get(piece)
            if ours.shape != theirs.shape or not torch.equal(ours.reshape(-1).view(torch.uint8),
                                                             theirs.contiguous().reshape(-1).view(torch.uint8)):
                differ.append(piece.hf_key)
    return differ
