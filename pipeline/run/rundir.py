"""One run directory, checkpoints/<model>/runs/<path>/: every file a run holds, named once.

  run.json               the resolved run (RunSpec)          metrics.jsonl   one JSON object per step
  first_batch/rank*.safetensors   each rank's step-1 batch    timings.json    start-up marks of rank 0
  checkpoint/step-N/     torchtitan DCP (complete once its .metadata and every rank's shard exist: what resume uses);
                         a run's last step also holds hf/ (its model in HF safetensors: what export links)
  export/                the HF export                        verify.json     verify's result
  logs/, tb/             per-rank logs, TensorBoard events    .lock           held by a live launch or export (gone after)
  plan/rank*.json        what each rank ran (parallel layout, step 1), when the run records it (rehearse)
  failure.json           a rank's one-line error (PipelineError), read back by the launcher; a launch that failed
                         before any progress leaves it alone in the directory (continuation.leave_only_the_failure)
  memory.json            each rank's peak memory against the estimate (pipeline.training.memory)
  ../.reference_loss.json   verify's plain-transformers loss of the source per distinct first batch,
                         beside the runs of every path of the model (runs/), so each is computed once
  saves.jsonl            one line per checkpoint save: seconds and bytes of DCP and of the HF save
  dcp_digests.json       HMAC-SHA256 of each step's DCP .metadata (a pickle) under the user's key kept outside
                         the root (pipeline.run.digest_key), recorded as the pipeline saves it: a resume loads a
                         step only when its .metadata still matches (check_dcp_metadata)
"""

from __future__ import annotations

import fcntl
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import read_json_object, regular_file

RUN_JSON = "run.json"
METRICS = "metrics.jsonl"
FIRST_BATCH = "first_batch"
TIMINGS = "timings.json"
CHECKPOINT = "checkpoint"
# Beside the DCP files of a run's last step (and step 0 of a STEPS=0 run): the model state dict as
# safetensors (torchtitan keys). DCP's own .metadata is a pickle, and this project never unpickles a
# checkpoint; export reads this file. It is renamed into place after DCP finished the step.
# step-N/hf: a run's last step, the model alone in HF safetensors (torchtitan's HF writer, the export dtype),
# renamed into place when complete; DCP's per-rank shards are written under its "sharded" folder first
# (torch.distributed.checkpoint.HuggingFaceStorageWriter) and deleted once consolidated.
HF_WEIGHTS = "hf"
HF_SHARDED = "sharded"
HF_HASHES = ".sha256.json"  # in step-N/hf: each shard's sha256, hashed by the ranks as they saved it (export's manifest)
ADAPTERS = "lora_adapters.safetensors"  # a LoRA run's last step: the adapters alone, torchtitan's keys
DCP_METADATA = ".metadata"
DCP_SHARD = re.compile(r"__(\d+)_\d+\.distcp")  # torch.distributed.checkpoint.filesystem: <prefix __rank_><n>.distcp
EXPORT = "export"
VERIFY = "verify.json"
LOGS = "logs"
LOCK = ".lock"
PLAN = "plan"
FAILURE = "failure.json"
MEMORY = "memory.json"
SHARED_REFERENCE_LOSS = ".reference_loss.json"  # in runs/, shared by the model's runs
SAVES = "saves.jsonl"
DCP_DIGESTS = "dcp_digests.json"


@dataclass(frozen=True)
class RunDir:
    path: Path

    def __post_init__(self):
        object.__setattr__(self, "path", Path(self.path))

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def run_json(self) -> Path:
        return self.path / RUN_JSON

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def first_batch(self) -> Path:
        return self.path / FIRST_BATCH

    @property
    def timings(self) -> Path:
        return self.path / TIMINGS

    @property
    def checkpoint(self) -> Path:
        return self.path / CHECKPOINT

    @property
    def export(self) -> Path:
        return self.path / EXPORT

    @property
    def adapter_export(self) -> Path:
        """`export --adapter`: a LoRA run's adapters alone, in the layout PEFT loads."""
        return self.path / f"{EXPORT}-adapter"

    @property
    def verify(self) -> Path:
        return self.path / VERIFY

    @property
    def logs(self) -> Path:
        return self.path / LOGS

    @property
    def lock(self) -> Path:
        return self.path / LOCK

    @property
    def plan(self) -> Path:
        return self.path / PLAN

    def plan_records(self) -> list[dict]:
        """Every rank's plan/rank<N>.json, in rank order."""
        files = sorted(self.plan.glob("rank*.json"), key=lambda f: int(f.stem.removeprefix("rank")))
        return [read_json_object(f, "train the run again (FRESH=1): its plan records are not the ranks'.") for f in files]

    @property
    def saves(self) -> Path:
        return self.path / SAVES

    @property
    def shared_reference_loss(self) -> Path:
        return self.path.parent / SHARED_REFERENCE_LOSS

    @property
    def memory(self) -> Path:
        return self.path / MEMORY

    @property
    def failure(self) -> Path:
        return self.path / FAILURE

    def record_failure(self, rank: int, problem: str, fix: str) -> None:
        """A rank stopping on a PipelineError leaves it here for the launcher (first rank wins)."""
        from pipeline.fsutil import atomic_write_text

        if not self.failure.exists():
            atomic_write_text(self.failure, json.dumps({"rank": rank, "problem": problem, "fix": fix}) + "\n")

    def recorded_failure(self) -> dict | None:
        try:
            return read_json_object(self.failure, "none: a record no rank wrote is left out.")
        except (OSError, PipelineError):
            return None

    def exists(self) -> bool:
        return self.run_json.is_file()

    def save_spec(self, spec) -> Path:
        from pipeline.fsutil import atomic_write_text

        atomic_write_text(self.run_json, spec.to_json())
        return self.run_json

    def spec(self):
        """The run's RunSpec, or a one-line error when there is no run here."""
        from pipeline.run.spec import RunSpec

        if not self.run_json.exists():
            raise PipelineError(f"{self.run_json} does not exist: no run there.",
                                "train first, e.g. `make train-native MODEL=tiny`.")
        return self._relocated(RunSpec.load(self.run_json))

    def _relocated(self, spec):
        """A run directory moved with its checkpoints root (or clone): the source and data files it
        recorded, gone from where they were, are read where they lie now relative to the run."""
        recorded, here = spec.run_dir, os.path.abspath(self.path)
        if recorded == here or not os.path.isabs(recorded):
            return spec
        for name in ("source_dir", "data_file", "eval_file"):
            value = getattr(spec, name)
            if value and os.path.isabs(value) and not os.path.exists(value):
                moved = os.path.normpath(os.path.join(here, os.path.relpath(value, recorded)))
                if os.path.exists(moved):
                    setattr(spec, name, moved)
        spec.run_dir = here
        return spec

    # ---- checkpoints ------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.checkpoint / f"step-{step}"

    def checkpoint_steps(self) -> dict[int, Path]:
        found = {}
        if self.checkpoint.is_dir():
            for item in self.checkpoint.iterdir():
                match = re.fullmatch(r"step-(\d+)", item.name)
                if match and item.is_dir():
                    found[int(match.group(1))] = item
        return found

    @property
    def dcp_digests(self) -> Path:
        return self.path / DCP_DIGESTS

    def _recorded_digests(self) -> dict:
        from pipeline.fsutil import read_small_text

        try:
            recorded = json.loads(read_small_text(self.dcp_digests))
        except (FileNotFoundError, json.JSONDecodeError, PipelineError):
            return {}
        return recorded if isinstance(recorded, dict) else {}

    def record_dcp_digest(self, step: int) -> None:
        """After the pipeline's own save of `step` (rank 0): its .metadata's keyed digest, kept atomically."""
        from pipeline.fsutil import atomic_write_text

        present = {str(s) for s in self.checkpoint_steps()}  # steps torchtitan purged drop out
        digests = {k: v for k, v in self._recorded_digests().items() if k in present}
        digests[str(step)] = self._keyed_digest(step, create=True)
        atomic_write_text(self.dcp_digests, json.dumps(digests, indent=1, sort_keys=True) + "\n")

    def check_dcp_metadata(self, step: int) -> None:
        """DCP's .metadata is a pickle, and loading it runs whatever it holds: a resume loads a step
        only when its .metadata is the one this pipeline wrote (a file planted in a shared run
        directory, or copied from elsewhere, is refused before any rank reads it)."""
        from pipeline.run import digest_key

        metadata = self.step_dir(step) / DCP_METADATA
        recorded = self._recorded_digests().get(str(step))
        if recorded is None or not digest_key.same(str(recorded), self._keyed_digest(step)):
            why = "no save of that step is recorded in" if recorded is None else "it differs from the digest recorded in"
            raise PipelineError(f"{metadata} is not the one this pipeline saved ({why} {self.dcp_digests}, keyed "
                                f"with {digest_key.key_path()}); DCP's metadata is a pickle and is not loaded.",
                                f"start over with FRESH=1, or remove {self.step_dir(step)} to resume from an earlier "
                                "step (a checkpoint from elsewhere is code: see docs/design.md).")

    def _keyed_digest(self, step: int, create: bool = False) -> str:
        """HMAC-SHA256 of a step's .metadata under the user's key, bound to the step (a digest recorded for
        one step does not pass another's .metadata). Bytes only: the pickle is never loaded."""
        import stat

        from pipeline.run import digest_key

        metadata = self.step_dir(step) / DCP_METADATA
        if not stat.S_ISREG(os.stat(metadata).st_mode):  # a FIFO would hang the check
            return ""
        with open(metadata, "rb") as handle:
            data = handle.read()
        return digest_key.digest(data, f"dcp-metadata step-{step}", self.checkpoints_root, create=create)

    @property
    def checkpoints_root(self) -> Path:
        """The root this run lies in (<root>/<model>/runs/<name>); a run directory elsewhere (a cluster's
        --run-dir) stands for itself."""
        return self.path.parents[2] if self.path.parent.name == "runs" and len(self.path.parents) > 2 else self.path

    def check_resume(self) -> None:
        """The step a resume would load (torchtitan: the last complete one) passes check_dcp_metadata."""
        steps = self.dcp_steps()
        if steps:
            self.check_dcp_metadata(steps[-1])

    def dcp_steps(self) -> list[int]:
        """Steps whose DCP save finished: DCP renames .metadata into place last (torchtitan
        resumes from the last of these)."""
        return sorted(s for s, d in self.checkpoint_steps().items() if (d / DCP_METADATA).exists())

    def complete_steps(self) -> list[int]:
        """Complete checkpoints, the ones a resume may start from: DCP finished (.metadata) and every
        rank's shard file is there. DCP's FileSystemWriter writes one `__<rank>_<n>.distcp` file per
        rank at least (one per rank with torchtitan's single thread), so the run's world size says
        which must be present without reading .metadata, a pickle this project never loads."""
        ranks = self._world_size()
        return [s for s in self.dcp_steps() if self._has_every_shard(self.step_dir(s), ranks)]

    def incomplete_steps(self) -> list[int]:
        """Step folders DCP began or that lost files: nothing a resume may load."""
        complete = set(self.complete_steps())
        return sorted(s for s in self.checkpoint_steps() if s not in complete)

    def _world_size(self) -> int | None:
        try:
            settings = read_json_object(self.run_json, "none: an unreadable record is refused where it is read.")["settings"]
            return int(settings.get("nproc_per_node", 1)) * int(settings.get("nnodes", 1))
        except (OSError, ValueError, KeyError, TypeError, AttributeError, PipelineError):
            return None

    @staticmethod
    def _has_every_shard(step: Path, ranks: int | None) -> bool:
        names = [p.name for p in step.iterdir()] if step.is_dir() else []
        shards = {int(m.group(1)) for m in map(DCP_SHARD.fullmatch, names) if m}
        return set(range(ranks)) <= shards if ranks else bool(shards)

    def exportable_steps(self) -> list[int]:
        """Complete checkpoints that also hold the HF save (a run's last step)."""
        complete = set(self.complete_steps())
        return sorted(s for s, d in self.checkpoint_steps().items() if s in complete and (d / HF_WEIGHTS).is_dir())

    def latest_exportable_step(self) -> int | None:
        steps = self.exportable_steps()
        return steps[-1] if steps else None

    def hf_weights(self, step: int | None = None) -> tuple[int, Path]:
        """The HF save (step-N/hf) of the last exportable (or the given) checkpoint."""
        steps = self.checkpoint_steps()
        if not steps:
            raise PipelineError(f"{self.path} has no checkpoint yet.",
                                "train first (`make train-… STEPS=N`; STEPS=0 saves the loaded weights).")
        if step is None:
            step = self.latest_exportable_step()
            if step is None:
                raise PipelineError(f"{self.path} has checkpoints of steps {sorted(steps)} but none holds {HF_WEIGHTS}/, "
                                    "the model a run saves at its last step: the run was cut short.",
                                    "rerun the training command; it resumes and finishes the run.")
            if step < max(self.dcp_steps()):
                print(f"warning: exporting step {step}; the later checkpoints {[s for s in self.dcp_steps() if s > step]} "
                      "belong to a run that has not finished (rerun training to finish it).")
        elif step not in steps:
            raise PipelineError(f"{self.path} has no checkpoint of step {step} (it has {sorted(steps)}).",
                                "pick one of those steps.")
        path = steps[step] / HF_WEIGHTS
        if not path.is_dir() or step not in self.complete_steps():
            raise PipelineError(f"{steps[step]} has no {HF_WEIGHTS}/: only a run's last step holds the model export "
                                f"reads (exportable here: {self.exportable_steps() or 'none'}).",
                                "export the last step, or resume or rerun training so its last step is saved completely.")
        return step, path

    def recorded_hf_hashes(self, step: int) -> dict[str, str]:
        """The sha256 of each shard of step-N/hf as its rank recorded it when it saved it (.sha256.json)."""
        from pipeline.fsutil import read_small_text

        record = self.step_dir(step) / HF_WEIGHTS / HF_HASHES
        try:
            recorded = json.loads(read_small_text(record, fix=self._save_again(step)))
            return {str(name): str(entry["sha256"]) for name, entry in recorded.items()}
        except FileNotFoundError as err:
            raise PipelineError(f"{record} does not exist: the sha256 the ranks recorded when they saved step {step} "
                                "are gone, and nothing tells its weights from edited ones.", self._save_again(step)) from err
        except (ValueError, TypeError, KeyError, AttributeError) as err:
            raise PipelineError(f"{record} is not the record the ranks write (name → sha256, bytes).",
                                self._save_again(step)) from err

    def hf_hashes(self, step: int) -> dict[str, str]:
        """step-N/hf's shards re-hashed and checked against the sha256 the ranks recorded as they saved
        them: shard name → sha256. The record is the reference, not the files: export hard-links these
        shards, so an export edited in place changes them too, and comparing the two would compare a
        file with itself."""
        import concurrent.futures

        from pipeline.checkpoint import manifest

        directory = self.step_dir(step) / HF_WEIGHTS
        recorded = self.recorded_hf_hashes(step)
        shards = sorted(p.name for p in directory.glob("*.safetensors"))
        unrecorded, gone = sorted(set(shards) - set(recorded)), sorted(set(recorded) - set(shards))
        if unrecorded or gone:
            raise PipelineError(f"{directory} does not hold the shards its ranks saved: not recorded {unrecorded[:3]}, "
                                f"missing {gone[:3]} ({HF_HASHES}).", self._save_again(step))
        workers = max(1, min(len(shards), os.cpu_count() or 1))  # hashlib releases the GIL: shards hash in parallel
        with concurrent.futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="sha256") as pool:
            found = dict(zip(shards, pool.map(lambda name: manifest.sha256(directory / name), shards)))
        for name in shards:
            if found[name] != recorded[name]:
                raise PipelineError(f"{directory / name} differs from the sha256 its rank recorded when it saved step "
                                    f"{step} ({HF_HASHES}): the saved weights were changed after the save (an export "
                                    "links these files: an edit of the export's shard changes them too).",
                                    self._save_again(step))
        return found

    def _save_again(self, step: int) -> str:
        return (f"delete {self.step_dir(step) / HF_WEIGHTS} and rerun the training command; it resumes at step {step} "
                "and saves the model again (then export with FORCE=1).")

    def hf_weights_dtype(self, step: int) -> str | None:
        """The dtype of step-N's HF save (torch's name: float32, bfloat16), None without a readable one."""
        from pipeline.checkpoint import hf_dir
        from pipeline.dtypes import SAFETENSORS_NAMES

        directory = self.step_dir(step) / HF_WEIGHTS
        if not directory.is_dir():
            return None
        try:
            dtypes = {info.dtype for info in hf_dir.read_tensors(directory).values()}
        except PipelineError:
            return None
        return SAFETENSORS_NAMES.get(dtypes.pop()) if len(dtypes) == 1 else None

    # ---- metrics ----------------------------------------------------------------------------

    def metric_records(self, warnings: list[str] | None = None) -> list[dict]:
        """metrics.jsonl by step (a repeated step keeps its latest line); torn or foreign lines
        are skipped, and named in `warnings` when given."""
        if not self.metrics.is_file():
            return []
        by_step: dict[int, dict] = {}
        for number, line in enumerate(self.metrics.read_text().splitlines(), 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                if warnings is not None:
                    warnings.append(f"{self.metrics}:{number} is not JSON; line skipped.")
                continue
            if not isinstance(record, dict) or any(not isinstance(record.get(k), (int, float)) for k in ("step", "loss")):
                if warnings is not None:
                    warnings.append(f"{self.metrics}:{number} lacks a numeric step or loss; line skipped.")
                continue
            record["step"] = int(record["step"])
            by_step[record["step"]] = record
        return [by_step[s] for s in sorted(by_step)]

    def drop_torn_metrics_tail(self) -> str | None:
        """A last line of metrics.jsonl cut short (what a kill mid-write leaves) removed before a resume
        appends after it, which would weld the two into one unreadable line: returns the warning to
        print, None when the file ends whole. A whole last object the kill left unterminated keeps its
        line (a newline is added)."""
        if not self.metrics.is_file():
            return None
        with open(self.metrics, "r+b") as handle:
            size = handle.seek(0, os.SEEK_END)
            start = max(0, size - TORN_LINE_SEARCH)
            handle.seek(start)
            tail = handle.read()
            body = tail[:-1] if tail.endswith(b"\n") else tail
            cut = body.rfind(b"\n")
            if cut < 0 and start > 0:
                return None  # a last line longer than any record the trainer writes: not a torn one
            last = body[cut + 1:]
            if not last.strip() or _is_json(last):
                if not tail.endswith(b"\n"):
                    handle.write(b"\n")
                return None
            handle.truncate(start + cut + 1)
        return (f"warning: the last line of {self.metrics} was cut short ({len(last)} bytes, what a kill while it was "
                "written leaves); dropped it, the resumed run logs that step again.")

    @staticmethod
    def metric_step(line: str) -> int | None:
        """The step of one metrics.jsonl line, None for a torn or foreign one."""
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            return None
        step = record.get("step") if isinstance(record, dict) else None
        return int(step) if isinstance(step, (int, float)) and not isinstance(step, bool) else None

    def step1_loss(self) -> float | None:
        """The logged step-1 loss, or None when step 1 was not logged."""
        return next((float(r["loss"]) for r in self.metric_records() if r["step"] == 1), None)

    def step1_token_loss(self) -> float | None:
        """The logged step-1 cross-entropy over the label tokens of the recorded first batch, what plain transformers
        recomputes on it (verify): `loss`, except in a DPO run, whose `loss` is the preference loss and which logs
        that cross-entropy, over every completion token, as `completion_loss` (pipeline.titan.dpo)."""
        record = next((r for r in self.metric_records() if r["step"] == 1), None)
        if record is None:
            return None
        return float(record[DPO_TOKEN_LOSS] if DPO_TOKEN_LOSS in record else record["loss"])

    def first_batches(self) -> list[dict]:
        from safetensors.torch import load_file

        files = sorted(self.first_batch.glob("rank*.safetensors"))
        if not files:
            raise PipelineError(f"{self.first_batch} holds no recorded batch.",
                                "run the training stage (STEPS ≥ 1 records it) before checking the step-1 loss.")
        for f in files:
            regular_file(f, "train the run again (FRESH=1): its recorded batch is not a file the ranks wrote.")
        return [load_file(str(f)) for f in files]


DPO_TOKEN_LOSS = "completion_loss"
TORN_LINE_SEARCH = 1 << 20  # the end of metrics.jsonl searched for its last line: a record is under 1 KiB


def _is_json(line: bytes) -> bool:
    try:
        json.loads(line)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False
    return True




class RunLock:
    """An exclusive flock on <run dir>/.lock for the life of a launch (or an export: it reads the
    checkpoints a live run rewrites, and two exports share one temporary sibling's target); the
    kernel drops it when the holder dies, so a lock left by a killed process is simply taken over.
    The holder deletes the file as it lets go (a finished run leaves no .lock behind); a process that
    opened the file before that deletion and then took the flock holds a file no longer there, so
    taking the lock counts only once the path still names the locked file."""

    def __init__(self, run: RunDir, activity: str = ""):
        self.path = run.lock
        self.activity = activity  # written beside the pid, for the refusal another process prints
        self.handle = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            self.handle = open(self.path, "a+")
            try:
                fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError as err:
                self.handle.seek(0)
                holder = self.handle.read().strip() or "another process"
                self.handle.close()
                raise PipelineError(f"{self.path.parent} is in use by a live run ({holder}).",
                                    "wait for it to finish or stop it; two writers in one run directory corrupt "
                                    "each other.") from err
            if self._names_the_held_file():
                break
            self.handle.close()  # its holder deleted it meanwhile: lock the file now at the path
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"pid {os.getpid()} on {os.uname().nodename}{f', {self.activity}' if self.activity else ''}\n")
        self.handle.flush()
        return self

    def _names_the_held_file(self) -> bool:
        try:
            return os.stat(self.path).st_ino == os.fstat(self.handle.fileno()).st_ino
        except FileNotFoundError:
            return False

    def __exit__(self, *exc) -> None:
        # Only the file this lock holds: a FRESH launch moved the old run (and its .lock) aside, and
        # the path may name the new run directory's lock, which another RunLock of the launch holds.
        if self._names_the_held_file():
            os.unlink(self.path)
        self.handle.close()
