"""Whether a launch may continue the run already in its directory, and how FRESH=1 discards one.

A run directory holds one experiment. A re-run continues it only when its resolved settings equal
the ones run.json recorded; more STEPS is "continue training". Anything else would train (or
not train) under a run.json that describes a run it is not, so it is refused in one line naming
the keys that differ and the two ways on: a new RUN_NAME, or FRESH=1.

FRESH=1 moves the old run aside with one rename (a killed discard leaves either the whole old run
or none of it, never a step's .metadata without its shards) and only then deletes it.

A launch that fails before the run made any progress leaves only failure.json in its directory (what
went wrong, the fix, and the last lines of its output): no run.json, logs or half-made folders for a
re-run, the report or a user to take for a run. The next launch replaces it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text, read_json_object
from pipeline.run import settings as settings_mod
from pipeline.run.rundir import DCP_METADATA, FAILURE, LOCK, RunDir

# Recorded fields that do not make a different experiment: the step count (more STEPS continues
# the run), where the run lives, and what the pipeline derives (memory estimate, the nki plan and
# override imports follow from the settings and may change with the pipeline's version), and the dtype
# of the last step's HF save (a run resumed at its last step with another one saves its model again in it).
NOT_COMPARED = {*(f"settings.{name}" for name in settings_mod.named("continues")),
                "run_dir", "memory", "nki", "overrides", "record_plan", "peak_flops_per_rank"}
DISCARDED_PREFIX = ".discarded-"
FAILURE_TAIL_LINES = 60  # of torchrun's output (rank 0's lines and torchrun's error summary), kept in failure.json


def flatten(record: dict) -> dict:
    """run.json's nested dict as dotted keys (settings.seq_len, arch.hidden_size)."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, dict) and key in ("settings", "arch"):
            flat |= {f"{key}.{k}": v for k, v in value.items()}
        else:
            flat[key] = value
    return flat


def differences(recorded: dict, resolved: dict) -> list[str]:
    """The compared keys whose values differ (settings.* named by the setting alone); a path (source_dir,
    data_file, a DATASET given as one) is the same path when it is, or when it lies where it lay
    relative to the run's own directory: a clone or checkpoints root moved as a whole keeps its runs."""
    old, new = flatten(_with_defaults(recorded)), flatten(resolved)
    keys = sorted((set(old) | set(new)) - NOT_COMPARED)
    return [k.removeprefix("settings.") for k in keys
            if old.get(k) != new.get(k) and not _same_place(old.get(k), old.get("run_dir"), new.get(k), new.get("run_dir"))]


def _same_place(old, old_run: str | None, new, new_run: str | None) -> bool:
    """Two absolute paths at the same place relative to their run directories (the paths as recorded,
    never resolved: a link's own location is what moved)."""
    paths = (old, old_run, new, new_run)
    if not all(isinstance(p, str) and os.path.isabs(p) for p in paths):
        return False
    return os.path.relpath(old, old_run) == os.path.relpath(new, new_run)


def _with_defaults(recorded: dict) -> dict:
    """A run.json written before a setting or field existed, read with that field's default (what
    the run did), so adding a setting to the pipeline does not turn every old run into another."""
    from pipeline.run.spec import RunSpec

    try:
        return {**recorded, **RunSpec.from_dict(recorded).to_dict()}
    except (TypeError, KeyError, ValueError):
        return recorded


def has_progress(run: RunDir) -> bool:
    """Something of a run is there to mix with: a checkpoint step or logged metrics."""
    return bool(run.checkpoint_steps()) or bool(run.metric_records())


def leave_only_the_failure(run: RunDir, problem: str, fix: str, output_tail: list[str] = ()) -> bool:
    """When `run` has no progress: delete all it holds but failure.json, written with the problem, the fix
    and `output_tail` (a rank's recorded failure keeps its keys). False (nothing touched) otherwise."""
    if not run.path.is_dir() or has_progress(run):
        return False
    record = {**(run.recorded_failure() or {}), "problem": problem, "fix": fix}
    if output_tail:
        record["output_tail"] = "".join(output_tail[-FAILURE_TAIL_LINES:])
    for item in run.path.iterdir():
        if item.name in (FAILURE, LOCK):  # the lock goes as its holder lets go
            continue
        if item.is_dir() and not item.is_symlink():
            shutil.rmtree(item, ignore_errors=True)
        else:
            item.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # a full disk: the launcher's one line still says what happened
        atomic_write_text(run.failure, json.dumps(record, indent=1) + "\n")
    return True


def check_continues(run: RunDir, spec) -> None:
    """Refuse, in one line, a launch that would continue `run` with other settings or fewer steps."""
    run_name = run.name

    if not run.run_json.exists() or not has_progress(run):  # a FIFO there is refused below, not skipped
        return
    fix = "start it again with FRESH=1, or give the new run another RUN_NAME."
    try:
        recorded = read_json_object(run.run_json, fix)
    except OSError as err:
        raise PipelineError(f"{run.run_json} is unreadable ({err}); the run there cannot be continued.", fix) from err
    ways_on = (f"give the new experiment its own name (RUN_NAME=<name>), or discard run {run_name!r} with FRESH=1")
    recorded = _with_defaults(recorded)
    changed = differences(recorded, spec.to_dict())
    if changed:
        shown = ", ".join(f"{k} ({_value(recorded, k)} → {_value(spec.to_dict(), k)})" for k in changed[:6])
        more = f" and {len(changed) - 6} more" if len(changed) > 6 else ""
        raise PipelineError(f"run {run_name!r} ({run.path}) was trained with other settings: {shown}{more}; "
                            "continuing it would mix two experiments.", ways_on + ".")
    done = max(run.complete_steps(), default=0)
    if spec.settings.steps < done:
        raise PipelineError(f"run {run_name!r} is already at step {done}; STEPS={spec.settings.steps} would train "
                            "nothing and record fewer steps than the checkpoints hold.",
                            f"give STEPS ≥ {done} to continue it, or {ways_on}.")


def _value(record: dict, key: str) -> str:
    flat = flatten(record)
    value = flat.get(key, flat.get(f"settings.{key}"))
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "…"


def remove_incomplete_steps(run: RunDir) -> list[int]:
    """Step folders with DCP's .metadata but without every rank's shard (a copy or deletion cut
    short) would be loaded by torchtitan's resume and crash it: each is renamed aside, then deleted."""
    removed = [s for s in run.incomplete_steps() if (run.step_dir(s) / DCP_METADATA).exists()]
    for step in removed:
        aside = run.checkpoint / f"{DISCARDED_PREFIX}step-{step}-{uuid.uuid4().hex[:8]}"
        os.rename(run.step_dir(step), aside)
        shutil.rmtree(aside, ignore_errors=True)
        print(f"warning: {run.step_dir(step)} lacked DCP shard files (an interrupted copy or deletion); removed it, "
              "the run resumes from its last complete step.", flush=True)
    return removed


def discard(run: RunDir) -> Path | None:
    """Move the run directory aside with one rename (an atomic step) and return where it went;
    the caller deletes it (delete_discarded) once the new run holds its own lock. Earlier
    discards of the same run cut short by a kill are deleted first."""
    delete_discarded(run)
    if not run.path.exists():
        return None
    aside = run.path.parent / f"{DISCARDED_PREFIX}{run.path.name}-{uuid.uuid4().hex[:8]}"
    os.rename(run.path, aside)
    run.path.mkdir()
    return aside


def delete_discarded(run: RunDir) -> None:
    pattern = re.compile(rf"{re.escape(DISCARDED_PREFIX + run.path.name)}-[0-9a-f]{{8}}")
    if run.path.parent.is_dir():
        for item in run.path.parent.iterdir():
            if pattern.fullmatch(item.name) and item.is_dir() and not item.is_symlink():
                shutil.rmtree(item, ignore_errors=True)
