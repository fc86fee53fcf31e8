"""pipeline/stages/train.py: the launcher imports neither torch nor torchtitan (dry runs of every
path included: the nki path's override check runs in a child), and a training that fails is
reported for what it is: a rank killed by a signal is named with the likely cause."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.run.rundir import RunDir
from pipeline.launch import launcher as train
from helpers import REPO

PROBE = textwrap.dedent("""
    import json, runpy, sys
    sys.argv = ["pipeline", "train", "--model", "tiny", "--path", sys.argv[1], "--dry-run"]
    try:
        runpy.run_module("pipeline", run_name="__main__")
    except SystemExit as exit:
        assert not exit.code, exit.code
    print(json.dumps({m: m in sys.modules for m in ("torch", "torchtitan", "transformers")}))
""")


@pytest.mark.parametrize("path", ["native", "hf", "nki"])
def test_the_launcher_imports_neither_torch_nor_torchtitan(tmp_path, path):
    result = subprocess.run([sys.executable, "-c", PROBE, path], cwd=REPO, capture_output=True, text=True,
                            env={"PIPELINE_CHECKPOINTS": str(tmp_path), "PATH": "/usr/bin:/bin"}, timeout=300)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1]) == {"torch": False, "torchtitan": False, "transformers": False}
    assert "launch command:" in result.stdout and "memory per rank (estimate" in result.stdout
    if path == "nki":  # the override check still ran (in a child process) and its summary is printed
        assert "overrides: dense_mask_attention → 2× FlexAttention; nki_rope → 2× CosSinRoPE" in result.stdout


DIES = "import os, signal, time\nif os.environ['RANK'] == '1':\n    os.kill(os.getpid(), signal.SIGKILL)\ntime.sleep(60)\n"


def test_a_rank_killed_by_a_signal_is_reported_as_killed(tmp_path):
    script = tmp_path / "dies.py"
    script.write_text(DIES)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
               "--role=rank", f"--log-dir={tmp_path / 'logs'}", str(script)]
    code, stderr_tail = train._run_teeing_stderr(command, None)
    assert code == 1 and train.root_cause(stderr_tail) == (1, -9)  # torchrun's own summary, parsed
    problem, fix = train._failure(code, stderr_tail, RunDir(tmp_path), oom_kills=0)
    assert problem.startswith("rank 1 was killed by SIGKILL, most likely by the kernel's out-of-memory killer")
    assert "NPROC=1" in fix and "SEQ_LEN" in fix
    problem, _ = train._failure(code, stderr_tail, RunDir(tmp_path), oom_kills=1)
    assert "the kernel's out-of-memory killer ran during the run" in problem


def test_a_ranks_own_error_is_the_launchers(tmp_path):
    run = RunDir(tmp_path)
    run.record_failure(1, "seq_len 9000 exceeds max_position_embeddings 4096.", "use SEQ_LEN ≤ 4096.")
    run.record_failure(0, "a later rank's error", "not this one")
    assert train._failure(1, [], run, 0) == ("seq_len 9000 exceeds max_position_embeddings 4096.", "use SEQ_LEN ≤ 4096.")


SLEEPS = "import os, pathlib, sys, time\npathlib.Path(sys.argv[1], os.environ['RANK']).write_text(str(os.getpid()))\ntime.sleep(120)\n"
LAUNCHER = "import sys\nfrom pipeline.launch import launcher\nlauncher._run_teeing_stderr(sys.argv[1:], None)\n"


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:  # a zombie waiting for its reaper is gone too
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_launcher_takes_torchrun_and_its_ranks_with_it(tmp_path):
    import os
    import signal
    import time

    script = tmp_path / "sleeps.py"
    script.write_text(SLEEPS)
    pids = tmp_path / "pids"
    pids.mkdir()
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
               f"--log-dir={tmp_path / 'logs'}", str(script), str(pids)]
    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER, *command], cwd=REPO, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len(list(pids.iterdir())) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    ranks = [int(p.read_text()) for p in pids.iterdir()]
    assert len(ranks) == 2, "the ranks never started"
    launcher.send_signal(signal.SIGKILL)  # as a CI timeout or kill -9 does
    launcher.wait()
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in ranks) and time.monotonic() < deadline:
        time.sleep(0.5)
    survivors = [pid for pid in ranks if _alive(pid)]
    for pid in survivors:
        os.kill(pid, signal.SIGKILL)
    assert not survivors, "torchrun's ranks outlived the killed launcher"


# A stand-in for torchrun: what a start that fails leaves (logs, TensorBoard, a rank's recorded error), and
# optionally one logged step first.
FAILS_EARLY = """
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
(run / "logs" / "attempt_0" / "1").mkdir(parents=True)
(run / "logs" / "attempt_0" / "1" / "stderr.log").write_text("Traceback ...")
(run / "tb").mkdir()
if sys.argv[2] == "record":
    (run / "failure.json").write_text(json.dumps({"rank": 1, "problem": "bad data.", "fix": "fix it."}))
if sys.argv[2] == "step":
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\\n")
print("the last words of the failed start", file=sys.stderr)
sys.exit(3)
"""


@pytest.fixture
def early_failure(tmp_path, monkeypatch):
    """(launch(mode), the run directory): a tiny native run whose torchrun is FAILS_EARLY in `mode`."""
    from pipeline.launch import torchrun
    from pipeline.training.resolve import RunRequest, resolve

    spec = resolve(RunRequest(model="tiny", path="native", dry_run=True, checkpoints_root=tmp_path))
    mode = {}
    monkeypatch.setattr(torchrun, "command", lambda s: [sys.executable, "-c", FAILS_EARLY, s.run_dir, mode["mode"]])

    def launch(how: str):
        mode["mode"] = how
        with pytest.raises(PipelineError) as err:
            train.launch(spec)
        return err.value

    return launch, RunDir(Path(spec.run_dir))


def test_a_run_failing_before_its_first_step_leaves_only_failure_json(early_failure):
    launch, run = early_failure
    err = launch("record")
    assert (err.problem, err.fix) == ("bad data.", "fix it.")
    assert sorted(p.name for p in run.path.iterdir()) == ["failure.json"]  # no run.json, logs/, tb/ or .lock
    recorded = json.loads(run.failure.read_text())
    assert recorded["rank"] == 1 and recorded["problem"] == "bad data." and recorded["fix"] == "fix it."
    assert "the last words of the failed start" in recorded["output_tail"]
    err = launch("plain")  # a rerun replaces it
    assert err.problem == f"training exited with status 3; logs are in {run.failure}."
    assert sorted(p.name for p in run.path.iterdir()) == ["failure.json"]
    assert json.loads(run.failure.read_text())["problem"] == err.problem


def test_a_run_that_logged_a_step_keeps_everything(early_failure):
    launch, run = early_failure
    err = launch("step")
    assert f"logs are in {run.logs}" in err.problem
    assert {"run.json", "metrics.jsonl", "logs", "tb"} <= {p.name for p in run.path.iterdir()}
    assert not run.lock.exists()


def test_a_launch_refused_before_torchrun_leaves_only_failure_json(early_failure, monkeypatch):
    import shutil

    launch, run = early_failure
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    err = launch("record")
    assert "GiB free; one checkpoint save of this run writes about" in err.problem
    assert sorted(p.name for p in run.path.iterdir()) == ["failure.json"]
    assert json.loads(run.failure.read_text())["problem"] == err.problem
