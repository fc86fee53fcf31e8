"""Stage `train`: resolve one training run and launch it with torchrun.

`--path` chooses the training path (pipeline.models.registry); everything else — launcher,
data, metrics, checkpoints — is shared. A dry run resolves and validates everything, prints the
resolved run and the exact command, and launches nothing. A run directory holds a lock while its
launch is alive: a second launch into it refuses, naming the live one.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import shlex
import shutil
import signal
import subprocess
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.models import registry
from pipeline.run import targets
from pipeline.run.rundir import RunDir
from pipeline.titan import compat
from pipeline.run.spec import RunSpec
from pipeline.training import torchrun
from pipeline.training.resolve import RunRequest, resolve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hub id, local HF directory, or tiny / tiny-moe")
    parser.add_argument("--path", required=True, choices=registry.names(), help="training path")
    parser.add_argument("--target", help="cpu, cuda or trn2 (detected when unset)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--nproc-per-node", type=int)
    parser.add_argument("--config", type=Path, help="your config file, layered over configs/<target>.toml key by key")
    parser.add_argument("--dataset", help="local (the model's data/train.jsonl), a .jsonl/.txt file, a torchtitan "
                        "dataset (c4, c4_test) or a Hub dataset id org/name (default: the config's)")
    parser.add_argument("--revision", help="the Hub revision the run must start from (as downloaded)")
    parser.add_argument("--titan-args", default="", help="torchtitan flags applied over the built config, e.g. "
                        "--titan-args='--training.steps 5 --lr-scheduler.warmup-steps 1' ('--help' lists them)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="discard this run's checkpoints instead of resuming")


def request(args: argparse.Namespace) -> RunRequest:
    return RunRequest(model=args.model, path=args.path, target=args.target, config=args.config, steps=args.steps,
                      seq_len=args.seq_len, nproc_per_node=args.nproc_per_node, dataset=args.dataset,
                      revision=args.revision,
                      titan_args=tuple(shlex.split(args.titan_args)), dry_run=args.dry_run)


class RunLock:
    """An exclusive flock on <run dir>/.lock for the life of the launch; the kernel drops it when the
    holder dies, so a lock left by a killed run is simply taken over."""

    def __init__(self, run: RunDir):
        self.path = run.lock
        self.handle = None

    def __enter__(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.handle = open(self.path, "a+")
        try:
            fcntl.flock(self.handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            self.handle.seek(0)
            holder = self.handle.read().strip() or "another process"
            self.handle.close()
            raise PipelineError(f"{self.path.parent} is in use by a live run ({holder}).",
                                "wait for it to finish or stop it; two runs in one directory corrupt each other.") from err
        self.handle.seek(0)
        self.handle.truncate()
        self.handle.write(f"pid {os.getpid()} on {os.uname().nodename}\n")
        self.handle.flush()
        return self

    def __exit__(self, *exc) -> None:
        self.handle.close()


def run(args: argparse.Namespace):
    target = targets.resolve(args.target)
    if not args.dry_run:
        targets.check_launchable(target)
    # The ranks build torchtitan's internals: a torchtitan without them is refused here, in one line.
    compat.check_torchtitan(target.name)
    spec = resolve(request(args))
    target = targets.TARGETS[spec.target]
    command = torchrun.command(spec)
    env_prefix = " ".join(f"{k}={v}" for k, v in target.launch_vars(dict(os.environ)).items())
    if args.dry_run:
        print(memory_line(spec))
        print(json.dumps(spec.to_dict(), indent=2))
        print("launch command:")
        print(" ".join(part for part in (env_prefix, shlex.join(command)) if part))
        return spec
    return launch(spec, fresh=args.fresh)


def launch(spec: RunSpec, fresh: bool = False) -> RunSpec:
    """Run a resolved spec's torchrun command in its run directory (locked while it lives)."""
    target = targets.TARGETS[spec.target]
    command = torchrun.command(spec)
    run_dir = RunDir(Path(spec.run_dir))
    with RunLock(run_dir):
        if fresh:
            for item in run_dir.path.iterdir():
                if item != run_dir.lock:
                    shutil.rmtree(item) if item.is_dir() and not item.is_symlink() else item.unlink()
        spec.save()
        print(memory_line(spec), flush=True)
        print(f"launching {spec.path} on {spec.target}: {shlex.join(command)}", flush=True)
        result = subprocess.run(command, env={**target.launch_env(dict(os.environ)), "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        raise PipelineError(_failure(result.returncode, run_dir), "read the first error in the rank logs above.")
    return spec


def memory_line(spec) -> str:
    m = spec.memory
    parts = ", ".join(f"{k} {v:.2f}" for k, v in m["parts_gib"].items())
    against = f" of {m['capacity_gib']:.0f} GiB ({m['usable_gib']:.1f} usable)" if m["capacity_gib"] else ""
    return f"memory per rank (estimate): {m['total_gib']:.2f} GiB{against}: {parts} GiB; {m['notes'][0]}"


def _failure(code: int, run: RunDir) -> str:
    if code < 0:
        name = signal.Signals(-code).name
        return f"torchrun was killed by {name}; logs are in {run.logs}."
    return f"training exited with status {code}; logs are in {run.logs}."
