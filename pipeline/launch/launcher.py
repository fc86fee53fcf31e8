"""Launch a resolved run: torchrun in the run's directory, under its lock, with torchrun's stderr
passed through live, and a failure turned into one line naming the cause (a rank's own recorded
error, a full disk, a signal, the out-of-memory killer) and the fix. A second launch into a run
directory that holds a live lock refuses, naming the live one.
"""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from pipeline import console, envvars
from pipeline.console import RankOutputFilter
from pipeline.data import dataset
from pipeline.errors import PipelineError
from pipeline.launch import torchrun
from pipeline.run import continuation, digest_key, diskspace, targets
from pipeline.run.rundir import RunDir, RunLock
from pipeline.run.spec import RunSpec
from pipeline.training import memory

# When the launcher started torchrun (time.time()), for the ranks' start-up timings (timings.json).


def launch(spec: RunSpec, fresh: bool = False, force: bool = False) -> RunSpec:
    """Run a resolved spec's torchrun command in its run directory (locked while it lives)."""
    forced = memory.check_host(spec, force)  # before anything of an old run goes (FRESH=1)
    if forced:
        print(forced, file=sys.stderr, flush=True)
    target = targets.TARGETS[spec.target]
    command = torchrun.command(spec)
    run_dir = RunDir(Path(spec.run_dir))
    with contextlib.ExitStack() as held:
        held.enter_context(RunLock(run_dir))
        oom_kills = _oom_kills()
        try:
            code, stderr_tail = _launch_locked(spec, fresh, command, run_dir, target, held)
        except PipelineError as err:
            continuation.leave_only_the_failure(run_dir, err.problem, err.fix or "")
            raise
        if code != 0:
            # A run that trained nothing keeps only failure.json, its logs' place taken by their last lines.
            logs = run_dir.logs if continuation.has_progress(run_dir) else run_dir.failure
            problem, fix = _failure(code, stderr_tail, run_dir, _oom_kills() - oom_kills, spec, logs=logs)
            continuation.leave_only_the_failure(run_dir, problem, fix, stderr_tail)
            raise PipelineError(problem, fix)
    return spec


def _launch_locked(spec: RunSpec, fresh: bool, command: list[str], run_dir: RunDir, target: targets.Target,
                   held: contextlib.ExitStack) -> tuple[int, list[str]]:
    """Everything checked, the old run discarded (FRESH) and run.json written: torchrun's (exit status, stderr tail)."""
    if fresh:
        # Everything the new run needs is checked before the old one goes (resolve checked the
        # config, checkpoint and memory; the data is read through here), then the old run is
        # moved aside in one rename and deleted once the new directory holds its own lock.
        dataset.check_readable(dataset.DataSource(spec.data_kind, spec.settings.dataset, spec.data_file,
                                                  spec.data_format))
        if continuation.discard(run_dir) is not None:
            held.enter_context(RunLock(run_dir))
            continuation.delete_discarded(run_dir)
    else:
        continuation.check_continues(run_dir, spec)
        continuation.remove_incomplete_steps(run_dir)
        torn = run_dir.drop_torn_metrics_tail()
        if torn:
            print(torn, file=sys.stderr, flush=True)
    run_dir.check_resume()  # the ranks check it too (launch files start them without this stage)
    digest_key.load(run_dir.checkpoints_root, create=True)  # the key the first save needs: sound before hours of steps
    diskspace.check_room_for_a_save(spec)
    run_dir.save_spec(spec)
    print(memory_line(spec), flush=True)
    _warn_if_short_of_memory(spec)
    run_dir.failure.unlink(missing_ok=True)
    print(f"launching {spec.path} on {spec.target}: {shlex.join(command)}", flush=True)
    env = {**target.launch_env(dict(os.environ), memory.host_need(spec)), "PYTHONUNBUFFERED": "1",
           envvars.LAUNCHED_AT: repr(time.time())}
    return _run_teeing_stderr(command, env, None if console.verbose() else RankOutputFilter)


def memory_line(spec) -> str:
    m = spec.memory
    parts = ", ".join(f"{k} {v:.2f}" for k, v in m["parts_gib"].items())
    against = f" of {m['capacity_gib']:.0f} GiB ({m['usable_gib']:.1f} usable)" if m["capacity_gib"] else ""
    return f"memory per rank (estimate): {m['total_gib']:.2f} GiB{against}: {parts} GiB; {m['notes'][0]}"


def _warn_if_short_of_memory(spec) -> None:
    """On CPU the ranks share this machine's memory: say so before a run that cannot fit."""
    available = _mem_available_gib()
    wanted = memory.host_need(spec) / memory.GIB
    if spec.target == "cpu" and available is not None and wanted > available:
        print(f"warning: {spec.settings.nproc_per_node} rank(s) need about {wanted:.1f} GiB (the estimate above plus "
              f"{memory.CPU_PROCESS_GIB} GiB for each process) and {available:.1f} GiB is available; the kernel may "
              "kill a rank (NPROC=1 needs less in all).", file=sys.stderr, flush=True)


def _mem_available_gib() -> float | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 2**20
    except OSError:
        pass
    return None


def _run_teeing_stderr(command: list[str], env: dict | None,
                       output_filter: type[RankOutputFilter] | None = None) -> tuple[int, list[str]]:
    """Run torchrun with its stdout and stderr passed through live (through an `output_filter`, one per
    stream, when given) and its stderr's last lines kept, unfiltered: torchrun's error summary there is
    the only place that says how a rank ended (exit status or signal). Returns (exit status, that tail);
    a filter's count of hidden lines is said in one line at the end."""
    proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE if output_filter else None, stderr=subprocess.PIPE,
                            text=True, errors="replace", bufsize=1,
                            preexec_fn=_stop_with_the_launcher if sys.platform.startswith("linux") else None)
    tail: collections.deque[str] = collections.deque(maxlen=400)
    filters = {name: output_filter() for name in ("stdout", "stderr")} if output_filter else {}

    def copy(source, sink, name: str) -> None:
        keep = filters[name].passes if filters else (lambda line: True)
        for line in source:
            if keep(line):
                sink.write(line)
                sink.flush()
            if name == "stderr":
                tail.append(line)

    readers = [threading.Thread(target=copy, args=(proc.stderr, sys.stderr, "stderr"), daemon=True)]
    if output_filter:
        readers.append(threading.Thread(target=copy, args=(proc.stdout, sys.stdout, "stdout"), daemon=True))
    for reader in readers:
        reader.start()
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        code = proc.wait()
    for reader in readers:
        reader.join(timeout=10)
    hidden = sum(f.hidden for f in filters.values())
    if hidden:
        print(f"({hidden} lines of torchtitan's start-up log and known warnings hidden; VERBOSE=1 shows them, "
              "the run's logs/ has every rank's)", flush=True)
    return code, list(tail)


def _stop_with_the_launcher() -> None:
    """In torchrun's process, before exec: SIGTERM when the launcher dies, however it dies. A killed
    launcher (kill -9, a CI timeout) otherwise left torchrun and its ranks training on, seen here for
    an hour, writing into a run the user may start again; torchrun stops its ranks on SIGTERM, and the
    ranks die with torchrun (training.entry). Popen runs this in the main thread's child, so the
    signal follows the launcher's main thread, which lives as long as the launcher."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def _oom_kills() -> int:
    """The kernel's count of out-of-memory kills since boot (-1 where /proc/vmstat lacks it)."""
    try:
        text = Path("/proc/vmstat").read_text()
    except OSError:
        return -1
    match = re.search(r"^oom_kill (\d+)$", text, re.MULTILINE)
    return int(match.group(1)) if match else -1


def root_cause(stderr_lines: list[str]) -> tuple[int, int] | None:
    """(rank, exit code; negative = killed by that signal) of torchrun's first observed failure."""
    text = "".join(stderr_lines)
    at = text.rfind("Root Cause")
    rank = re.search(r"^\s*rank\s*:\s*(\d+)", text[at:], re.MULTILINE) if at >= 0 else None
    code = re.search(r"^\s*exitcode\s*:\s*(-?\d+)", text[at:], re.MULTILINE) if at >= 0 else None
    return (int(rank.group(1)), int(code.group(1))) if rank and code else None


def _failure(code: int, stderr_lines: list[str], run: RunDir, oom_kills: int, spec=None,
             logs: Path | None = None) -> tuple[str, str]:
    """(problem, fix) of a failed torchrun; `logs`: where its output is kept (default the run's logs/)."""
    logs = logs or run.logs
    recorded = run.recorded_failure()
    if recorded:  # a rank stopped on a one-line error of its own
        return recorded["problem"], recorded["fix"]
    if spec is not None and diskspace.disk_is_full(spec):  # even failure.json could not be written
        return (f"training exited with status {code} and the disk holding {run.path} is full "
                f"({diskspace.free_bytes(run.path) / diskspace.GIB:.2f} GiB free, less than one checkpoint save): a "
                f"save most likely failed with \"No space left on device\" (cut from the rank logs in {logs}, "
                "on that disk).", "free space there (or set PIPELINE_CHECKPOINTS to a larger disk), then rerun the "
                "same command: it resumes from the last complete checkpoint.")
    if code < 0:
        return f"torchrun was killed by {signal.Signals(-code).name}; logs are in {logs}.", \
            "rerun the same command to resume from the last checkpoint."
    cause = root_cause(stderr_lines)
    if cause is None or cause[1] >= 0:
        which = f" (rank {cause[0]}, exit status {cause[1]})" if cause else ""
        return f"training exited with status {code}{which}; logs are in {logs}.", \
            "read the first error in the rank logs above."
    rank, signum = cause[0], -cause[1]
    try:
        name = signal.Signals(signum).name
    except ValueError:
        name = f"signal {signum}"
    if signum != signal.SIGKILL:
        return f"rank {rank} was killed by {name}; logs are in {logs}.", "read the rank's log above for what it was doing."
    peak = _last_memory(run)
    seen = "the kernel's out-of-memory killer ran during the run" if oom_kills > 0 else \
        "most likely by the kernel's out-of-memory killer"
    return (f"rank {rank} was killed by SIGKILL, {seen} (this machine: {_memory_total_gib():.0f} GiB"
            f"{f'; peak RSS logged by rank 0: {peak:.1f} GiB' if peak else ''}); logs are in {logs}.",
            "give each rank more memory: fewer ranks (NPROC=1), a smaller SEQ_LEN or local_batch_size, "
            "activation_checkpoint = \"full\", or stop other memory users; then rerun to resume.")


def _last_memory(run: RunDir) -> float | None:
    records = run.metric_records()
    return float(records[-1]["memory_gib"]) if records and "memory_gib" in records[-1] else None


def _memory_total_gib() -> float:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
