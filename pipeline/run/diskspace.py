"""A full disk, said as such: checked before a launch, and named when a save failed on it.

A rank's logs live on the run's disk too, so when a checkpoint save fills it the rank's own
"No space left on device" is cut from them; the launcher reads the cause from failure.json (the
rank records the errno of the failed save) or, when even that could not be written, from the
disk itself.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from pipeline.errors import PipelineError

GIB = 2**30
# Bytes a checkpoint save writes per parameter: fp32 weights and AdamW's two fp32 moments in DCP; a run's
# last step adds its model in HF safetensors, in the export dtype. A tied embedding is one parameter (one
# pair of moments) under two names in the model's state dict, and DCP writes its fp32 weight under each
# (tiny, measured: 159,185,418 bytes of DCP = 12 × 9,970,496 parameters + 4 × 9,723,904 tied + 643,850).
DCP_BYTES_PER_PARAM = 4 * 3
TIED_COPY_BYTES_PER_PARAM = 4
DCP_OVERHEAD_BYTES = 1 << 20  # .metadata, the train, dataloader and scheduler states, per-tensor records
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def save_bytes(spec) -> int:
    """What the largest checkpoint save of the run (its last step's: DCP and the HF save) writes, all ranks
    together: the estimate, or the largest save the run recorded (saves.jsonl) when that is more. Only
    what one save adds: the disk must hold that much more than it holds now, nothing is added for margin."""
    from pipeline.dtypes import DTYPES

    arch = spec.arch
    tied = arch.vocab_size * arch.hidden_size if arch.tie_word_embeddings else 0
    dcp = arch.num_params * DCP_BYTES_PER_PARAM + tied * TIED_COPY_BYTES_PER_PARAM + DCP_OVERHEAD_BYTES
    hf = _hf_elements(spec) * DTYPES[spec.settings.export_dtype].bytes
    return max(dcp + hf, _largest_recorded_save(Path(spec.run_dir)))


def _hf_elements(spec) -> int:
    """The values the HF save holds: the source's tensors (a tied head the source stores is saved too), or
    the architecture's parameters where the source cannot be read (a dry run before download)."""
    import math

    from pipeline.checkpoint import hf_dir

    try:
        return sum(math.prod(info.shape) for info in hf_dir.read_tensors(Path(spec.source_dir)).values())
    except (OSError, PipelineError):
        return spec.arch.num_params


def _largest_recorded_save(run_dir: Path) -> int:
    import json

    from pipeline.run.rundir import RunDir

    largest = 0
    from pipeline.fsutil import read_small_text

    try:  # a regular file only: a FIFO there must not hang the check before a launch
        lines = read_small_text(RunDir(run_dir).saves).splitlines()
    except (OSError, PipelineError):
        return 0
    for line in lines:
        try:
            record = json.loads(line)
            largest = max(largest, int(record["dcp_bytes"]) + int(record["hf_bytes"]))
        except (ValueError, TypeError, KeyError):
            continue  # a line torn by a kill
    return largest


def free_bytes(path: Path) -> int:
    """Free bytes on the filesystem holding `path` (its nearest existing ancestor)."""
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_room_for_a_save(spec) -> None:
    """Before a launch: the run's disk can take at least one more checkpoint save (torchtitan
    writes the new step before it purges old ones)."""
    need, free = save_bytes(spec), free_bytes(Path(spec.run_dir))
    if free < need:
        raise PipelineError(f"the disk holding {spec.run_dir} has {free / GIB:.2f} GiB free; one checkpoint save of "
                            f"this run writes about {need / GIB:.2f} GiB.",
                            "free space there, or set PIPELINE_CHECKPOINTS to a larger disk.")


def full_disk_error(err: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind `err`, wherever DCP or torch wrapped it (causes, contexts,
    DCP's CheckpointException.failures of every rank), or None."""
    stack, seen = [err], set()
    while stack:
        current = stack.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in FULL_ERRNOS:
            return current
        stack += [current.__cause__, current.__context__]
        failures = getattr(current, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack += [f[0] if isinstance(f, tuple) else f for f in failures.values()]
    return None


def full_disk_failure(error: OSError, run_dir: Path) -> tuple[str, str]:
    """(problem, fix) of a save that failed on a full disk."""
    where = error.filename or run_dir
    return (f"a checkpoint save failed: {error.strerror or 'No space left on device'} ({errno.errorcode.get(error.errno)}) "
            f"writing {where}; {free_bytes(Path(run_dir)) / GIB:.2f} GiB free there.",
            "free space on that disk (or set PIPELINE_CHECKPOINTS to a larger one), then rerun the same command: it "
            "resumes from the last complete checkpoint.")


def disk_is_full(spec) -> bool:
    """After a failed run without a recorded cause: is the run's disk too full for another save?"""
    try:
        return free_bytes(Path(spec.run_dir)) < save_bytes(spec)
    except OSError:
        return False
