"""Hostile and faulty inputs, as a careful tester tries them (issue 19): each is refused in one
`error: … Fix: …` line with exit status 2 (or, for a value that is only data, passed as data), and
nothing outside the run's own directory changes: every case runs against a temporary checkpoints
root carrying the pipeline's marker and a directory of its own outside it, both snapshotted before
and compared after. A command smuggled into a value would touch a canary file there.

The cases are cheap: `make -n` or a dry run where that shows the behaviour, a real `make` only where
the shell must run the recipe, one small random checkpoint (seconds) for what needs a model, and
every subprocess bounded in memory (RLIMIT_AS) and time, so the old behaviours (a 24 GB read of
/dev/zero, a hang) fail the test instead of the machine.
"""

from __future__ import annotations

import json
import os
import pickle
import resource
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import helpers
from helpers import REPO
from pipeline.run import rundir
from pipeline.run.rundir import RunDir
from tiny_checkpoint import small_random_checkpoint

MARKER = ".pipeline-checkpoints"  # pipeline.run.store.ROOT_MARKER, spelled out: the Makefile checks the same name
MEMORY_LIMIT = 6 << 30  # a refusal needs far less; the old /dev/zero read grew past 24 GB
TIMEOUT = 120


# ---- the harness ----------------------------------------------------------------------------------

def _bounded() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def cli(*args: str, root: Path, env: dict | None = None, bounded: bool = True) -> subprocess.CompletedProcess:
    """`python -m pipeline …` with its checkpoints under `root`, bounded in time and (unless it trains:
    the ranks inherit the limit) in memory."""
    return helpers.cli(*args, root=root, env={"HF_HUB_OFFLINE": "1", **(env or {})}, timeout=TIMEOUT * (1 if bounded else 5),
                       preexec_fn=_bounded if bounded else None)


def make(*args: str, root: Path, env_extra: dict | None = None) -> subprocess.CompletedProcess:
    """`make …` for real (recipes run in the shell), never rebuilding the shared .venv (-o: its stamp
    counts as up to date)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL", "IN_CONTAINER")}
    env = helpers.pipeline_env(root, {**env, "HF_HUB_OFFLINE": "1", **(env_extra or {})})
    return subprocess.run(["make", "--no-print-directory", "-o", ".venv/.installed", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT, preexec_fn=_bounded)


def one_error_line(result: subprocess.CompletedProcess, *expected: str) -> str:
    """Exit 2, no traceback, exactly one `error: … Fix: …` line, holding every `expected` fragment."""
    assert result.returncode == 2, f"exit {result.returncode}\n{result.stdout[-2000:]}\n{result.stderr[-2000:]}"
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and " Fix: " in lines[0], result.stderr
    for fragment in expected:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def snapshot(directory: Path) -> dict[str, tuple]:
    """Every entry under `directory` (links not followed): kind, size, mtime, link target."""
    found = {}
    for parent, dirs, files in os.walk(directory):
        for name in dirs + files:
            path = Path(parent) / name
            info = path.lstat()
            found[str(path.relative_to(directory))] = (info.st_mode, info.st_size, info.st_mtime_ns,
                                                      os.readlink(path) if path.is_symlink() else None)
    return found


class World:
    """A checkpoints root of ours, a directory outside it and a canary path a smuggled command would touch."""

    def __init__(self, base: Path):
        self.root = base / "checkpoints"
        self.root.mkdir()
        (self.root / MARKER).write_text("")
        self.outside = base / "outside"
        self.outside.mkdir()
        (self.outside / "precious.txt").write_text("keep me")
        self.canary = self.outside / "pwned"
        self.before = self.state()

    def state(self) -> tuple[dict, dict]:
        return snapshot(self.root), snapshot(self.outside)

    def unchanged(self, except_under: Path | None = None) -> None:
        """Nothing changed in the root (but under `except_under`, the run's own directory) nor outside."""
        assert not self.canary.exists(), "a command smuggled into a value ran"
        root_now, outside_now = self.state()
        assert outside_now == self.before[1]
        if except_under is not None:
            keep = str(Path(except_under).relative_to(self.root))
            parents = {str(p) for p in Path(keep).parents}
            def mine(key):
                return key == keep or key.startswith(keep + os.sep) or key in parents
            root_now = {k: v for k, v in root_now.items() if not mine(k)}
            before = {k: v for k, v in self.before[0].items() if not mine(k)}
        else:
            before = self.before[0]
        assert root_now == before


@pytest.fixture
def world(tmp_path) -> World:
    return World(tmp_path)


@pytest.fixture(scope="module")
def local_model(tmp_path_factory) -> Path:
    """The module's one model: a small random HF checkpoint directory (seconds; no pretraining)."""
    return small_random_checkpoint(tmp_path_factory.mktemp("hostile") / "model")


def model_copy(local_model: Path, directory: Path) -> Path:
    shutil.copytree(local_model, directory)
    return directory


# ---- 1. command injection through Make variables ---------------------------------------------------

@pytest.mark.parametrize("template", ["tiny; touch {canary} #", "tiny$$(touch {canary})", "tiny`touch {canary}`"])
def test_a_command_in_model_is_data_not_shell(world, template):
    result = make("data", f"MODEL={template.format(canary=world.canary)}", root=world.root)
    one_error_line(result, "MODEL=")
    world.unchanged()


def test_a_command_in_dataset_does_not_run_nor_cut_the_flags(world):
    """`DATASET='local; touch X #'` used to run touch and comment out --dry-run: it trained for real."""
    result = make("train-native", "MODEL=tiny", "DRY_RUN=1", f"DATASET=local; touch {world.canary} #", root=world.root)
    one_error_line(result, "DATASET=")
    assert "launching" not in result.stdout
    world.unchanged()


def test_a_command_in_config_is_a_path(world):
    result = make("train-native", "MODEL=tiny", "DRY_RUN=1", f"CONFIG=x.toml; touch {world.canary} #", root=world.root)
    one_error_line(result, "does not exist", "CONFIG")
    world.unchanged()


def test_the_typo_guard_runs_no_command_from_a_variable_name(world):
    # A name with a slash or a space is a target to make: `cd` goes to $HOME (the outside dir), `>` creates.
    result = make("help", f"A;cd;>{world.canary.name};B=1", root=world.root, env_extra={"HOME": str(world.outside)})
    assert result.returncode != 0 and "unknown variable" in result.stderr
    world.unchanged()


def test_every_value_reaches_the_stage_as_one_word():
    """What the shell receives (make -n): each hostile value comes back whole after shlex splitting."""
    values = {"MODEL": "a b;c", "DATASET": "$(x)`y`#z", "CONFIG": "it's.toml", "STEPS": "1;2", "REVISION": "r&s"}
    # On make's command line `$$` is a dollar sign ($(x) alone would be make's own variable x).
    result = subprocess.run(["make", "-n", "--no-print-directory", "train-native", "DRY_RUN=1",
                             *(f"{k}={v.replace('$', '$$')}" for k, v in values.items())], cwd=REPO,
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if "-m pipeline train " in line)
    words = shlex.split(line)
    for flag, name in (("--model", "MODEL"), ("--dataset", "DATASET"), ("--config", "CONFIG"), ("--steps", "STEPS"),
                       ("--revision", "REVISION")):
        assert words[words.index(flag) + 1] == values[name]


# ---- 2. launch files quote what the user gave -------------------------------------------------------

# Cluster launch files pull a pushed image by digest (a local tag is refused: `make push` first).
PUSHED = "registry.example/qwen3@sha256:" + "0" * 64


def test_launch_paths_with_commands_stay_paths(world, tmp_path):
    run_dir = f"/fsx/$(touch {world.canary})/run`touch {world.canary}`"
    out = world.root / "tiny" / "launch" / "out $(touch x)"
    result = cli("launch", "--scheduler", "slurm", "--nodes", "2", "--model", "tiny", "--target", "cpu",
                 "--run-dir", run_dir, "--output", str(out), "--image", PUSHED, root=world.root)
    assert result.returncode == 0, result.stderr
    text = (out / "train.sbatch").read_text()
    heredoc = text[text.index("NODE_CMD="):text.index("srun ")]
    # What each node's shell runs, printed word by word instead of executed.
    show = tmp_path / "show-words"
    show.write_text("#!/bin/sh\nprintf '%s\\n' \"$@\"\n")
    show.chmod(0o755)
    probe = heredoc + ('\nNODE_CMD="${NODE_CMD#*&& }"\n'
                       f'MASTER_ADDR=node-a RDZV_ID=7 SLURM_NODEID=1 bash -c "${{NODE_CMD/exec /exec {show} }}"')
    words = subprocess.run(["bash", "-c", probe], capture_output=True, text=True, timeout=30).stdout.splitlines()
    assert f"--log-dir={run_dir}/logs/node-1" in words, words
    assert "--rdzv-endpoint=node-a:29500" in words and "--rdzv-id=7" in words
    assert str(out / "run.json") in words
    eks = world.root / "tiny" / "launch" / "eks"
    assert cli("launch", "--scheduler", "eks", "--nodes", "2", "--model", "tiny", "--target", "cpu",
               "--run-dir", run_dir, "--output", str(eks), "--image", PUSHED, root=world.root).returncode == 0
    import yaml

    job = list(yaml.safe_load_all((eks / "job.yaml").read_text()))[2]
    command = job["spec"]["template"]["spec"]["containers"][0]["command"][2]
    printed = subprocess.run(["bash", "-c", f"set -- {command}; printf '%s\\n' \"$@\""], capture_output=True, text=True,
                             env={"JOB_COMPLETION_INDEX": "0", "PATH": os.environ["PATH"]}).stdout.splitlines()
    assert f"--log-dir={run_dir}/logs/node-0" in printed, printed
    world.unchanged(except_under=world.root / "tiny" / "launch")


def test_launch_refuses_a_newline_in_a_path(world):
    result = cli("launch", "--scheduler", "slurm", "--nodes", "2", "--model", "tiny", "--target", "cpu",
                 "--run-dir", "/fsx/run\nNODE\ntouch x", root=world.root)
    one_error_line(result, "--run-dir", "control character")
    world.unchanged()


# ---- 3. resume never unpickles a .metadata the pipeline did not write ---------------------------------

class _Payload:
    def __init__(self, canary: Path):
        self.canary = canary

    def __reduce__(self):
        return (os.system, (f"touch {shlex.quote(str(self.canary))}",))


@pytest.fixture(scope="module")
def imported(local_model, tmp_path_factory) -> tuple[Path, str]:
    """(root, MODEL): the module's model downloaded (imported) with its data, in a root of its own."""
    root = tmp_path_factory.mktemp("imported") / "checkpoints"
    for stage in ("download", "data"):
        result = cli(stage, "--model", str(local_model), root=root)
        assert result.returncode == 0, result.stderr
    return root, str(local_model)


@pytest.mark.slow  # the module's model imported (≈20 s on 2 cores)
def test_a_planted_dcp_metadata_is_refused_before_any_rank_starts(imported, tmp_path):
    from pipeline.run import store

    root, model = imported
    run = store.home(model, root).run("native")
    step = run.step_dir(5)
    step.mkdir(parents=True)
    canary = tmp_path / "pwned"
    (step / ".metadata").write_bytes(pickle.dumps(_Payload(canary)))
    (step / "__0_0.distcp").touch()  # the shard a 1-rank save writes: a complete-looking step, not one a resume drops
    try:
        result = cli("train", "--model", model, "--path", "native", "--steps", "6", "--nproc-per-node", "1", root=root)
        one_error_line(result, f"{step}/.metadata", "not the one this pipeline saved", "FRESH=1")
        assert "launching" not in result.stdout and not canary.exists()
        # a recorded digest that no longer matches is refused the same way
        (run.path / "dcp_digests.json").write_text(json.dumps({"5": "0" * 64}))
        one_error_line(cli("train", "--model", model, "--path", "native", "--steps", "6", "--nproc-per-node", "1",
                           root=root), "differs from the digest")
        assert not canary.exists()
    finally:
        shutil.rmtree(run.path)


def test_a_save_records_its_metadata_digest_and_resume_accepts_it(tmp_path):
    """What the trainer's save hook records is what the check accepts (and only that)."""
    import hashlib

    from pipeline.errors import PipelineError
    from pipeline.run import digest_key
    from pipeline.run.rundir import RunDir

    run = RunDir(tmp_path / "run")
    for step in (2, 4):
        run.step_dir(step).mkdir(parents=True)
        (run.step_dir(step) / ".metadata").write_bytes(b"dcp metadata of step %d" % step)
        run.record_dcp_digest(step)
    recorded = json.loads(run.dcp_digests.read_text())
    assert recorded["4"] == digest_key.digest(b"dcp metadata of step 4", "dcp-metadata step-4", run.path) and set(recorded) == {"2", "4"}
    assert recorded["4"] != hashlib.sha256(b"dcp metadata of step 4").hexdigest()  # keyed: not what anyone can compute
    run.check_resume()
    (run.step_dir(4) / ".metadata").write_bytes(b"something else")
    with pytest.raises(PipelineError, match="differs from the digest"):
        run.check_resume()


# ---- 4. symlinks out of a model directory -----------------------------------------------------------

def test_a_symlink_out_of_a_local_model_is_refused(world, local_model, tmp_path):
    model = model_copy(local_model, tmp_path / "linked-model")
    (model / "chat_template.jinja").symlink_to(world.outside / "precious.txt")
    result = cli("download", "--model", str(model), root=world.root)
    one_error_line(result, "chat_template.jinja is a symlink", "outside the checkpoint directory")
    world.unchanged()


def test_a_symlink_inside_the_model_directory_is_fine(world, local_model, tmp_path):
    model = model_copy(local_model, tmp_path / "inner-link")
    (model / "tokenizer_config.json").rename(model / "real_tokenizer_config.json")
    (model / "tokenizer_config.json").symlink_to("real_tokenizer_config.json")
    result = cli("download", "--model", str(model), root=world.root)
    assert result.returncode == 0, result.stderr


# ---- 5. clean deletes only under a checkpoints root of ours ---------------------------------------

@pytest.mark.parametrize("target", ["clean", "distclean"])
def test_clean_refuses_a_root_without_the_marker(tmp_path, target):
    home = tmp_path / "not-ours"
    for part in ("project/data", "project/runs", "thesis/report", "x/launch"):
        (home / part).mkdir(parents=True)
    (home / "notes.txt").write_text("mine")
    before = snapshot(home)
    result = make(target, "VENV=" + str(tmp_path / "no-venv"), root=home)
    assert result.returncode == 2 and f"{home} carries no {MARKER}" in result.stderr, result.stderr
    assert snapshot(home) == before


def test_the_stages_mark_the_root_they_write(tmp_path):
    root = tmp_path / "fresh"
    assert cli("data", "--model", "tiny", root=root).returncode == 0
    assert (root / MARKER).is_file()
    (root / "tiny" / "runs").mkdir()
    assert make("clean", root=root).returncode == 0
    assert not (root / "tiny" / "runs").exists() and not (root / "tiny" / "data").exists()


# ---- 9. bounded reads: refused before allocating -------------------------------------------------

def test_a_config_json_claiming_1e8_layers_is_refused_at_once(world, local_model, tmp_path):
    model = model_copy(local_model, tmp_path / "deep")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 10**8}))
    started = time.monotonic()
    result = cli("download", "--model", str(model), root=world.root)
    one_error_line(result, "num_hidden_layers is 100000000")
    assert time.monotonic() - started < 60
    world.unchanged()


def test_config_dev_zero_is_refused_unread(world):
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--config", "/dev/zero", root=world.root)
    one_error_line(result, "/dev/zero is not a regular file", "CONFIG")
    world.unchanged()


def test_a_huge_config_is_refused_unread(world, tmp_path):
    big = tmp_path / "big.toml"
    with open(big, "wb") as handle:
        handle.truncate(2 << 30)  # sparse: no disk used
    one_error_line(cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--config", str(big),
                       root=world.root), "bytes", "not read")


def test_a_dataset_linked_to_dev_zero_is_refused(world, tmp_path):
    link = tmp_path / "data.jsonl"
    link.symlink_to("/dev/zero")
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--dataset", str(link), root=world.root)
    one_error_line(result, "is not a regular file", "/dev/zero")
    world.unchanged()


def test_a_config_json_that_is_a_device_is_refused(world, local_model, tmp_path):
    model = model_copy(local_model, tmp_path / "device-config")
    (model / "config.json").unlink()
    (model / "config.json").symlink_to("/dev/zero")
    one_error_line(cli("download", "--model", str(model), root=world.root), "config.json")
    world.unchanged()


# ---- 10. checks the ranks made, made before launch ---------------------------------------------

def test_fewer_documents_than_ranks_is_refused_before_launch(world, tmp_path):
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "the only document"}) + "\n")
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--dataset", str(data),
                 "--nproc-per-node", "2", root=world.root)
    one_error_line(result, "holds 1 document(s), fewer than the 2 data-parallel ranks")
    two = tmp_path / "two.txt"
    two.write_text("first paragraph\nstill the first\n\nsecond paragraph\n")
    assert cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--dataset", str(two),
               "--nproc-per-node", "2", root=world.root).returncode == 0
    world.unchanged()


def test_seq_len_beyond_max_position_embeddings_is_refused(world):
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--seq-len", "1000000", root=world.root)
    one_error_line(result, "SEQ_LEN=1000000 is beyond the model's max_position_embeddings (4096")
    world.unchanged()


def test_more_experts_per_token_than_experts_is_refused(world, tmp_path):
    from pipeline.checkpoint.embedded import EMBEDDED

    model = tmp_path / "moe"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**EMBEDDED["tiny-moe"].config, "num_experts_per_tok": 99}))
    one_error_line(cli("download", "--model", str(model), root=world.root), "num_experts_per_tok 99 is more than")
    world.unchanged()


# ---- 11. a full disk is named -----------------------------------------------------------------------

def _tiny_spec(root: Path):
    from pipeline.training.resolve import RunRequest, resolve

    return resolve(RunRequest(model="tiny", path="native", dry_run=True, checkpoints_root=root))


def test_launch_refuses_a_disk_without_room_for_a_save(world, monkeypatch):
    from pipeline.errors import PipelineError
    from pipeline.launch import launcher as train

    spec = _tiny_spec(world.root)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 1000, 1000))
    monkeypatch.setattr(train, "_run_teeing_stderr", lambda *a: pytest.fail("torchrun was started"))
    with pytest.raises(PipelineError, match="GiB free; one checkpoint save of this run writes about"):
        train.launch(spec)
    world.unchanged(except_under=Path(spec.run_dir))


FAILING_RANK = """
import errno, sys
from torch.distributed.checkpoint.api import CheckpointException
from pipeline.training import entry

def run(spec, rank):
    try:  # what DCP raises: each rank's error wrapped, the OSError in its context
        try:
            raise OSError(errno.ENOSPC, "No space left on device", spec.run_dir + "/checkpoint/step-5/__0_0.distcp")
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")
    except RuntimeError as wrapped:
        raise CheckpointException("write", {0: (wrapped, None)})

entry.run = run
entry.main(sys.argv[1:])
"""


def test_a_failed_save_on_a_full_disk_is_recorded_with_its_cause(tmp_path):
    """DCP wraps each rank's error in a CheckpointException (a BaseException) around torch's
    RuntimeError: the rank digs the ENOSPC out of it and records it in failure.json, which the
    launcher prints."""
    from pipeline.run.rundir import RunDir
    from pipeline.launch import launcher as train

    spec = _tiny_spec(tmp_path / "root")
    run_json = RunDir(Path(spec.run_dir)).save_spec(spec)
    rank = subprocess.run([sys.executable, "-c", FAILING_RANK, str(run_json)], cwd=REPO, capture_output=True,
                          text=True, timeout=TIMEOUT)
    assert rank.returncode == 2 and "Traceback" not in rank.stderr, rank.stderr[-3000:]
    problem, fix = train._failure(1, [], RunDir(Path(spec.run_dir)), 0, spec)
    assert "No space left on device (ENOSPC)" in problem and "__0_0.distcp" in problem and "free space" in fix


def test_the_launcher_names_a_full_disk_when_no_rank_could_say(tmp_path, monkeypatch):
    from pipeline.run.rundir import RunDir
    from pipeline.launch import launcher as train

    spec = _tiny_spec(tmp_path / "root")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12, 0))
    problem, fix = train._failure(1, [], RunDir(Path(spec.run_dir)), 0, spec)
    assert "is full" in problem and "No space left on device" in problem and "resumes" in fix


# ---- 12. one writer per run directory: export takes the run's lock ---------------------------------

HOLD = ("import sys, time; from pipeline.run.rundir import RunDir, RunLock\n"
        "with RunLock(RunDir(sys.argv[1])):\n    print('held', flush=True)\n    time.sleep(600)\n")


@pytest.mark.slow  # the module's model imported (≈20 s on 2 cores)
def test_export_while_the_run_is_busy_is_refused(imported):
    from pipeline.run import store
    from pipeline.training.resolve import RunRequest, resolve

    root, model = imported
    spec = resolve(RunRequest(model=model, path="native", checkpoints_root=root))
    run = store.home(model, root).run("native")
    RunDir(Path(spec.run_dir)).save_spec(spec)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run.path)], cwd=REPO, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        before = snapshot(run.path)
        result = cli("export", "--model", model, "--path", "native", root=root)
        one_error_line(result, f"{run.path} is in use by a live run (pid {holder.pid}")
        assert snapshot(run.path) == before and not run.export.exists()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        shutil.rmtree(run.path)


# ---- 13. fix texts that say what fixes it ---------------------------------------------------------

def test_download_of_a_directory_without_config_json_does_not_say_run_download(world, local_model, tmp_path):
    model = model_copy(local_model, tmp_path / "no-config")
    (model / "config.json").unlink()
    line = one_error_line(cli("download", "--model", str(model), root=world.root), "config.json does not exist")
    assert "make download" not in line
    world.unchanged()


@pytest.mark.slow  # the module's model imported (≈20 s on 2 cores)
def test_a_truncated_weights_file_names_the_fix_that_works(imported):
    from pipeline.run import store
    from pipeline.training.resolve import RunRequest, resolve

    root, model = imported
    spec = resolve(RunRequest(model=model, path="native", checkpoints_root=root))
    RunDir(Path(spec.run_dir)).save_spec(spec)
    run = store.home(model, root).run("native")
    run.step_dir(0).mkdir(parents=True)
    (run.step_dir(0) / ".metadata").write_bytes(b"x")
    for rank in range(spec.settings.world_size):  # every rank's shard: a complete step
        (run.step_dir(0) / f"__{rank}_0.distcp").touch()
    (run.step_dir(0) / rundir.HF_WEIGHTS).mkdir()
    (run.step_dir(0) / rundir.HF_WEIGHTS / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{")  # cut short
    try:
        line = one_error_line(cli("export", "--model", model, "--path", "native", root=root), "truncated or corrupt")
        assert "re-download" not in line and "delete" in line and "rerun the training command" in line
    finally:
        shutil.rmtree(run.path)


def test_a_missing_config_file_is_a_path_problem_not_a_target_one(world):
    line = one_error_line(cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--config", "missing.toml",
                              root=world.root), "missing.toml does not exist")
    assert "pick TARGET" not in line and "CONFIG" in line


def test_verify_of_a_missing_checkpoint_writes_nothing(world, tmp_path):
    where = tmp_path / "somewhere"
    where.mkdir()
    result = cli("verify", "--checkpoint", str(where / "nonexistent"), "--reference", str(where), root=world.root)
    one_error_line(result, "is not a directory")
    assert list(where.iterdir()) == []
    world.unchanged()


def test_a_bad_hub_id_leaves_no_empty_folder(world):
    result = cli("download", "--model", "no-such-org/no-such-model", root=world.root)
    one_error_line(result, "no-such-org/no-such-model")
    world.unchanged()


@pytest.mark.slow
def test_a_disk_that_fills_during_a_save_is_named_by_the_launcher(imported, tmp_path):
    """A real full disk: the run directory on a small tmpfs with room for the launch check and step 1's
    save, not for step 2's. The rank logs there are cut; the launcher's line still names the cause."""
    from pipeline.run import store

    root, model = imported
    run = store.home(model, root).run("native")
    run.path.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=100m", "tmpfs", str(run.path)], capture_output=True,
                             text=True)
    if mounted.returncode != 0:
        shutil.rmtree(run.path)
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    config = tmp_path / "every-step.toml"
    config.write_text("[train]\ncheckpoint_interval = 1\nkeep_latest_k = 0\n")
    try:
        result = cli("train", "--model", model, "--path", "native", "--steps", "2", "--nproc-per-node", "1",
                     "--config", str(config), root=root, bounded=False)
        # torchrun prints its own summary of the failed rank (ChildFailedError) before the launcher's line
        assert result.returncode == 2, result.stderr[-3000:]
        line = result.stderr.strip().splitlines()[-1]
        assert line.startswith("error:") and "No space left on device" in line, line
        assert "resume" in line.split(" Fix: ")[1]
        assert 1 in run.dcp_steps() and 2 not in run.dcp_steps()  # step 1 stays complete for the resume
    finally:
        subprocess.run(["umount", str(run.path)], check=False)
        shutil.rmtree(run.path, ignore_errors=True)
