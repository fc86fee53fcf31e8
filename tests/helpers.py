"""What the test modules share, as a plain module (`from helpers import …`; fixtures stay in
conftest.py): the one CLI runner, a run's metrics, the on-disk layout of a checkpoints root
(checkpoints/<key>/{source.json, source/, data/, runs/<path>/}, spelled out here rather than taken
from pipeline.run.store, so a layout change shows in tests), and small fake runs. Tests live in one
folder per package: tests/<package>/test_<package>_<module>.py tests pipeline/<package>/<module>.py
(tests/stages/test_stages_main.py: pipeline/__main__.py; tests/core/: the top-level modules);
tests/e2e/ runs whole flows, tests/project/ checks the repository itself."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from pipeline import envvars
from pipeline.run import rundir, targets

REPO = Path(__file__).resolve().parent.parent


# What download and data leave for a model: its record, the checkpoint, the training text.
MODEL_PARTS = ("source.json", "source", "data")


def missing_tool(reason: str) -> None:
    """A tool the test needs is not here: a skip with its reason locally, a failure in CI (which sets it up)."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"CI must provide this: {reason}")
    pytest.skip(reason)


def pipeline_env(root: Path, env: dict | None = None) -> dict:
    """This environment with checkpoints under `root` and the CPU target's glibc settings (as the launcher
    sets them for the embedded models), `env` over both."""
    return {**os.environ, **targets.RETAIN_FREED_MEMORY, envvars.CHECKPOINTS: str(root), **(env or {})}


def cli(*args: str, root: Path, env: dict | None = None, timeout: int = 900, **popen) -> subprocess.CompletedProcess:
    """`python -m pipeline …` exactly as a user runs it, with outputs under `root`; never raises on a
    non-zero exit (run_pipeline does)."""
    return subprocess.run([sys.executable, "-m", "pipeline", *args], cwd=REPO, env=pipeline_env(root, env),
                          capture_output=True, text=True, timeout=timeout, **popen)


def run_pipeline(*args: str, root: Path, check: bool = True, timeout: int = 600,
                 env: dict | None = None) -> subprocess.CompletedProcess:
    """cli(), failing the test on a non-zero exit unless check=False."""
    result = cli(*args, root=root, env=env, timeout=timeout)
    if check and result.returncode != 0:
        raise AssertionError(f"pipeline {' '.join(args)} failed ({result.returncode}):\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result


def read_metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def source_dir(root: Path, model: str = "tiny") -> Path:
    """An embedded model's downloaded checkpoint (an embedded model's key is its name)."""
    return root / model / "source"


def run_dir(root: Path, model: str, path: str) -> Path:
    """An embedded model's run of one training path."""
    return root / model / "runs" / path


def copy_model(checkpoints: Path, root: Path, model: str = "tiny", link: bool = False) -> Path:
    """`root` holding `model` as downloaded and prepared in `checkpoints` (source.json, source/, data/),
    copied, or with source/ and data/ symlinked when `link`; no runs."""
    (root / model).mkdir(parents=True, exist_ok=True)
    for part in MODEL_PARTS:
        src, dst = checkpoints / model / part, root / model / part
        if src.is_dir():
            os.symlink(src, dst) if link else shutil.copytree(src, dst)
        else:
            shutil.copy2(src, dst)
    return root


def fake_trn2_host(tmp_path: Path):
    """A doctor.Host whose /dev and /sys look like a trn2.48xlarge's: 16 Neuron devices, the driver, 16 EFA."""
    from pipeline.host import doctor

    dev, sys_ = tmp_path / "dev", tmp_path / "sys"
    dev.mkdir()
    for i in range(16):
        (dev / f"neuron{i}").touch()
    (sys_ / "module" / "neuron").mkdir(parents=True)
    (sys_ / "module" / "neuron" / "version").write_text("2.31.7.0\n")
    for i in range(16):
        (sys_ / "class" / "infiniband" / f"rdmap{i}s0" / "device").mkdir(parents=True)
    return doctor.Host(dev=dev, sys=sys_, home=tmp_path / "home")


EXPORT_MODELS = ("tiny", "tiny-moe")


# Two gloo ranks for tiny (FSDP-sharded weights gathered into the safetensors copy), one for
# tiny-moe (keeps the session short on 2 cores).
EXPORT_NPROC = {"tiny": "2", "tiny-moe": "1"}


TRAINED_STEPS = 2


HF_WEIGHTS = "hf"  # the folder a run's last step saves its model in, HF safetensors, beside DCP's files


DCP_METADATA = ".metadata"  # DCP renames it into place last: the step's save finished


def tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    from pipeline.checkpoint import hf_dir

    out = {}
    for shard in hf_dir.shard_files(directory):
        out |= load_file(str(shard))
    return out


def fake_run(runs: Path, tmp_path: Path, model: str = "tiny", step: int = 0, source: Path | None = None) -> Path:
    """A run dir with a real run's run.json and one checkpoint's HF save (step-N/hf), for editing."""
    src = run_dir(runs, model, "native")
    run = tmp_path / "run"
    run.mkdir()
    spec = json.loads((src / "run.json").read_text())
    spec["run_dir"] = str(run)
    if source is not None:
        spec["source_dir"] = str(source)
    (run / "run.json").write_text(json.dumps(spec))
    (run / "checkpoint" / f"step-{step}").mkdir(parents=True)
    shutil.copytree(src / "checkpoint" / f"step-{step}" / HF_WEIGHTS, weights_path(run, step))
    # DCP's marker of a finished save, which export requires beside the weights (its content is never read)
    shutil.copy(src / "checkpoint" / f"step-{step}" / DCP_METADATA, run / "checkpoint" / f"step-{step}" / DCP_METADATA)
    plant_dcp_shards(src / "checkpoint" / f"step-{step}", run / "checkpoint" / f"step-{step}")
    return run


def plant_dcp_shards(trained_step: Path, step: Path) -> None:
    """Empty files named as a trained step's DCP shards: a step counts complete when every rank's
    shard is there (their content is never read outside torchtitan's resume)."""
    for shard in trained_step.glob("*.distcp"):
        (step / shard.name).touch()


def weights_path(run: Path, step: int = 0) -> Path:
    """A run step's HF save: its folder (the shards are `hf_shard(run, step)`)."""
    return run / "checkpoint" / f"step-{step}" / HF_WEIGHTS


def hf_shard(run: Path, step: int = 0, key: str = "model.norm.weight") -> Path:
    """The shard of a run step's HF save that holds `key`."""
    index = json.loads((weights_path(run, step) / "model.safetensors.index.json").read_text())
    return weights_path(run, step) / index["weight_map"][key]


def record_hashes(weights: Path) -> None:
    """Rewrite a step's HF save's .sha256.json as its ranks would have recorded it, had they saved the
    shards as they are now: a fake save that really holds what a test put in it (an edit is not)."""
    from pipeline.checkpoint import manifest

    (weights / rundir.HF_HASHES).write_text(json.dumps({
        p.name: {"sha256": manifest.sha256(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
        for p in sorted(weights.glob("*.safetensors"))}))


def tied_source_with_lm_head(runs: Path, tmp_path: Path) -> Path:
    """tiny's source with lm_head.weight stored (as some tied Hub checkpoints do), in its own shard."""
    from safetensors.torch import save_file

    from pipeline.checkpoint import hf_dir

    source = tmp_path / "source-with-head"
    shutil.copytree(source_dir(runs, "tiny"), source)
    embed = tensors(source)["model.embed_tokens.weight"]
    save_file({"lm_head.weight": embed.clone()}, str(source / "lm_head.safetensors"), metadata={"format": "pt"})
    index = json.loads((source / hf_dir.INDEX).read_text())
    index["weight_map"]["lm_head.weight"] = "lm_head.safetensors"
    (source / hf_dir.INDEX).write_text(json.dumps(index))
    return source


# The container test builds a full image on a private Docker engine (~20 min cold on 2 cores, seconds
# with the engine's build cache); .ci/run asks for it, a local `make test` only with the variable set.
# The report header says which, either way.
CONTAINER_TESTS = os.environ.get(envvars.CONTAINER_TESTS) == "1"


def dry_run_spec(stdout: str) -> dict:
    """The resolved run a `train --dry-run` prints: the JSON object from its `{` line up to `launch command:`
    (the nki plan and the memory estimate are printed before it)."""
    start, end = stdout.index("\n{\n") + 1 if not stdout.startswith("{\n") else 0, stdout.index("\nlaunch command:")
    return json.loads(stdout[start:end])


def plant_incomplete_step(run_dir: Path, step: int) -> Path:
    """What a kill during a save leaves: DCP shard files, no .metadata, no HF save (its temporary folder)."""
    directory = run_dir / "checkpoint" / f"step-{step}"
    directory.mkdir(parents=True)
    (directory / "__0_0.distcp").write_bytes(b"\0" * 4096)
    (directory / f".{rundir.HF_WEIGHTS}.tmp").mkdir()
    (directory / f".{rundir.HF_WEIGHTS}.tmp" / "model-00001-of-00001.safetensors").write_bytes(b"\0" * 64)
    return directory


C4_MARKER = "Otters ledger the tidepool inventory at dawn"


def c4_stand_in(directory: Path, shards: int = 3, docs: int = 4) -> Path:
    """A local stand-in laid out like allenai/c4 (the Hub is unreachable here): en/c4-train.0000X-of-01024.json.gz,
    gzipped JSON lines of text/timestamp/url, as DATASET_MIRROR (pipeline.data.staged)."""
    import gzip

    (directory / "en").mkdir(parents=True)
    for shard in range(shards):
        rows = [{"text": f"{C4_MARKER}: shard {shard} document {i}, with words enough for a window.",
                 "timestamp": "2019-04-25T12:57:54Z", "url": f"https://example.org/{shard}/{i}"} for i in range(docs)]
        with gzip.open(directory / "en" / f"c4-train.{shard:05d}-of-01024.json.gz", "wt") as handle:
            handle.write("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def recorded_run(directory: Path, spec, steps_done: int = 2) -> rundir.RunDir:
    """A run directory as a finished run leaves it: run.json, metrics, every rank's DCP shards."""
    spec.run_dir = str(directory)
    rundir.RunDir(Path(spec.run_dir)).save_spec(spec)
    run = rundir.RunDir(directory)
    run.metrics.write_text("".join(json.dumps({"step": s, "loss": 5.0}) + "\n" for s in range(1, steps_done + 1)))
    step = run.step_dir(steps_done)
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"x")
    for rank in range(spec.world_size):
        (step / f"__{rank}_0.distcp").write_bytes(b"x")
    return run


def resolved(root: Path):
    """The embedded tiny's native CPU run under `root`, resolved as a dry run resolves it."""
    from pipeline.training.resolve import RunRequest, resolve

    return resolve(RunRequest(model="tiny", path="native", target="cpu", dry_run=True, checkpoints_root=root))
