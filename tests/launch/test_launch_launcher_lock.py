"""The run directory's lock: a second launch into a run directory a live launch holds is refused in
one line naming the holder (and --fresh deletes nothing of it); a lock left by a killed launch is
taken over."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.run.rundir import RunDir
from pipeline.run.rundir import RunLock
from helpers import REPO, cli
from tiny_checkpoint import ok, one_error_line, small_random_checkpoint

HOLD = ("import sys, time; from pipeline.run.rundir import RunDir; from pipeline.run.rundir import RunLock\n"
        "with RunLock(RunDir(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n")


def hold(run_dir: Path) -> subprocess.Popen:
    """Another launch holding the lock (RunLock itself, in its own process)."""
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


@pytest.fixture
def holder(tmp_path):
    processes = []

    def start(run_dir: Path) -> subprocess.Popen:
        processes.append(hold(run_dir))
        return processes[-1]

    yield start
    for process in processes:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_a_live_holder_is_named_and_a_killed_ones_lock_taken_over(tmp_path, holder):
    run_dir = RunDir(tmp_path / "runs" / "native")
    live = holder(run_dir.path)
    with pytest.raises(PipelineError) as err:
        with RunLock(run_dir):
            pass
    assert f"{run_dir.path} is in use by a live run (pid {live.pid} on {socket.gethostname()})" in err.value.problem
    live.send_signal(signal.SIGKILL)  # no clean-up: the lock file stays, naming the dead launch
    live.wait()
    assert f"pid {live.pid}" in run_dir.lock.read_text()
    with RunLock(run_dir):
        assert run_dir.lock.read_text() == f"pid {os.getpid()} on {os.uname().nodename}\n"


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> tuple[Path, str]:
    """(checkpoints root, MODEL): a small local checkpoint, downloaded (imported) and with its data."""
    base = tmp_path_factory.mktemp("lock")
    model = str(small_random_checkpoint(base / "model"))
    root = base / "checkpoints"
    ok(cli("download", "--model", model, root=root))
    ok(cli("data", "--model", model, root=root))
    return root, model


def test_second_launch_is_refused_in_one_line_and_fresh_deletes_nothing(local_model, holder):
    from pipeline.run import store

    root, model = local_model
    run_dir = store.home(model, root).run("native")
    live = holder(run_dir.path)
    (run_dir.path / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')  # the live run's output
    result = cli("train", "--model", model, "--path", "native", "--steps", "1", "--fresh", root=root)
    line = one_error_line(result)
    assert f"{run_dir.path} is in use by a live run (pid {live.pid} on" in line
    assert "launching" not in result.stdout
    assert (run_dir.path / "metrics.jsonl").read_text() == '{"step": 1, "loss": 1.0}\n'
    assert not run_dir.run_json.exists()


def test_the_lock_file_goes_with_its_holder_and_only_its_own(tmp_path):
    run_dir = RunDir(tmp_path / "runs" / "native")
    with RunLock(run_dir):
        assert run_dir.lock.is_file()
    assert not run_dir.lock.exists() and run_dir.path.is_dir()
    # FRESH: the old run (its lock inside) moved aside, the new directory locked too; the old lock's exit
    # must not delete the new one's file while that is still held.
    outer = RunLock(run_dir).__enter__()
    run_dir.path.rename(tmp_path / "aside")
    run_dir.path.mkdir()
    with RunLock(run_dir):
        outer.__exit__(None, None, None)
        assert run_dir.lock.is_file()
    assert not run_dir.lock.exists()


def test_a_lock_taken_on_a_file_its_holder_deleted_is_taken_again(tmp_path, monkeypatch):
    """A process that opened .lock just before its holder deleted it locks the file at the path, never
    the deleted one (a third process would lock the new file and two would write one run)."""
    import fcntl

    real_flock = fcntl.flock
    run_dir = RunDir(tmp_path / "native")
    first = RunLock(run_dir).__enter__()
    calls = []

    def flock_after_the_holder_let_go(handle, flags):
        if not calls:
            first.__exit__(None, None, None)  # the holder deletes the file this handle opened
        calls.append(handle)
        return real_flock(handle, flags)

    monkeypatch.setattr(fcntl, "flock", flock_after_the_holder_let_go)
    with RunLock(run_dir) as second:
        assert len(calls) == 2  # the deleted file's lock was let go, the new file's taken
        assert run_dir.lock.is_file()
        assert os.fstat(second.handle.fileno()).st_ino == os.stat(run_dir.lock).st_ino
