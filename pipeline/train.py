"""Stage `train`: resolve one training run and launch it with torchrun.

`--path` chooses the model implementation (hf, native, nki); everything else — launcher,
data, metrics, checkpoints — is shared. A dry run resolves and validates everything,
prints the resolved run and the exact command, and launches nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from pipeline import hf_checkpoint, paths, settings, targets
from pipeline.errors import PipelineError
from pipeline.qwen3_arch import check_against
from pipeline.run_spec import RunSpec

PATH_PREPARERS = {}
# Modules that register a path's preparer, imported only when that path is trained.
PREPARER_MODULES = {"nki": "pipeline.nki.prepare"}


def prepares(path: str):
    """Register a per-path hook that validates/extends the RunSpec (overrides, constraints)."""

    def wrap(fn):
        PATH_PREPARERS[path] = fn
        return fn

    return wrap


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", required=True, choices=settings.PATHS, help="training path")
    parser.add_argument("--target", help="cpu, cuda or trn2 (detected when unset)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--nproc-per-node", type=int)
    parser.add_argument("--config", type=Path, help="config file (default configs/<target>.toml)")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--fresh", action="store_true", help="discard this run's checkpoints instead of resuming")


def resolve(args: argparse.Namespace) -> RunSpec:
    target = targets.resolve(args.target)
    cfg = settings.load(target.name, args.path, args.config)
    cfg = settings.with_overrides(cfg, steps=args.steps, seq_len=args.seq_len, nproc_per_node=args.nproc_per_node)
    name = paths.model_name(args.model)
    hf_dir = paths.hf_dir(args.model)
    if args.dry_run and not (hf_dir / "config.json").exists():
        arch = _arch_without_download(args.model)
    else:
        arch = hf_checkpoint.validate(paths.downloaded_hf_dir(args.model)).arch
    if cfg.flavor:
        from pipeline.native_model import flavor_arch

        check_against(arch, flavor_arch(cfg.flavor, arch), f"flavor {cfg.flavor!r} in configs/{target.name}.toml")
    if cfg.dataset == "local" and not args.dry_run and not paths.data_file(args.model).exists():
        raise PipelineError(f"{paths.data_file(args.model)} does not exist.", f"run `make data MODEL={args.model}` first.")
    spec = RunSpec(
        model_name=name, path=args.path, target=target.name, hf_dir=str(hf_dir),
        run_dir=str(paths.run_dir(args.model, args.path)), arch=arch.to_dict(),
        data_file=str(paths.data_file(args.model)) if cfg.dataset == "local" else None,
        peak_flops_per_rank=target.peak_flops_per_rank(cfg.lnc),
        **settings.shared_with(cfg, RunSpec),
    )
    _check_parallelism(spec)
    if target.name == "cpu" and args.path != "hf":
        # The hf path's transformers model has its own attention and experts: nothing to replace.
        from pipeline.cpu_overrides_names import CPU_OVERRIDES

        spec.overrides = list(CPU_OVERRIDES)
    if args.path in PREPARER_MODULES:
        import importlib

        importlib.import_module(PREPARER_MODULES[args.path])
    if args.path in PATH_PREPARERS:
        PATH_PREPARERS[args.path](spec, cfg)
    return spec


def _arch_without_download(model: str):
    """Dry runs work before download: embedded configs are known, Hub configs are not."""
    from pipeline.embedded import EMBEDDED
    from pipeline.qwen3_arch import arch_from_config

    if model in EMBEDDED:
        return arch_from_config(EMBEDDED[model].config, f"embedded {model}")
    known = Path(__file__).resolve().parent.parent / "configs" / "hub_configs" / f"{paths.model_name(model)}.json"
    if known.exists():
        return arch_from_config(json.loads(known.read_text()), str(known))
    raise PipelineError(f"{model!r} is not downloaded and its config.json is not known here.",
                        f"run `make download MODEL={model}` first.")


def _check_parallelism(spec: RunSpec) -> None:
    world = spec.nproc_per_node * spec.nnodes
    arch = spec.arch
    tp = spec.tensor_parallel
    if world % tp:
        raise PipelineError(f"tensor_parallel={tp} does not divide the {world} ranks.", "choose a divisor of the world size.")
    if arch["num_key_value_heads"] % tp or arch["num_attention_heads"] % tp:
        raise PipelineError(f"tensor_parallel={tp} does not divide the heads ({arch['num_attention_heads']}/"
                            f"{arch['num_key_value_heads']} kv).", "choose a TP degree that divides the kv heads.")
    if spec.sequence_parallel and spec.seq_len % tp:
        raise PipelineError(f"seq_len={spec.seq_len} is not divisible by tensor_parallel={tp} (sequence parallelism).",
                            f"use a multiple of {tp}.")
    if spec.data_parallel_shard not in (-1,) and spec.data_parallel_shard * tp != world:
        raise PipelineError(f"data_parallel_shard={spec.data_parallel_shard} × tensor_parallel={tp} ≠ {world} ranks.",
                            "set data_parallel_shard = -1 to use every remaining rank.")


NODE_LOG_SUBDIR = "node-${SLURM_NODEID:-${JOB_COMPLETION_INDEX:-${NODE_RANK:-0}}}"


def torchrun_command(spec: RunSpec) -> list[str]:
    run_json = str(Path(spec.run_dir) / "run.json")
    log_dir = f"{spec.run_dir}/logs"
    if spec.nnodes == 1:
        launch = ["--standalone", "--nnodes=1"]
    else:
        launch = [f"--nnodes={spec.nnodes}", "--rdzv-backend=c10d", "--rdzv-endpoint=${MASTER_ADDR}:${MASTER_PORT:-29500}",
                  "--rdzv-id=${RDZV_ID}"]
        # In one shared log dir every node's torchrun writes <rdzv id>_<random>/attempt_0/<local rank 0..>,
        # so which node wrote a log is lost; a subdir per node keeps it. The node's shell expands it
        # (Slurm, an EKS Indexed Job, or NODE_RANK set by hand).
        log_dir += f"/{NODE_LOG_SUBDIR}"
    return [sys.executable, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={spec.nproc_per_node}",
            "--local-ranks-filter=0", "--role=rank", "--tee=3", f"--log-dir={log_dir}",
            "-m", "pipeline.titan_entry", run_json]


def run(args: argparse.Namespace) -> RunSpec:
    if not args.dry_run:
        targets.check_launchable(targets.resolve(args.target))
    spec = resolve(args)
    target = targets.TARGETS[spec.target]
    command = torchrun_command(spec)
    env_prefix = " ".join(f"{k}={v}" for k, v in target.env.items())
    if args.dry_run:
        print(json.dumps(asdict(spec), indent=2))
        print("launch command:")
        print(" ".join(part for part in (env_prefix, shlex.join(command)) if part))
        return spec
    run_dir = Path(spec.run_dir)
    if args.fresh and run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    spec.save()
    print(f"launching {spec.path} on {spec.target}: {shlex.join(command)}", flush=True)
    result = subprocess.run(command, env={**os.environ, **target.env, "PYTHONUNBUFFERED": "1"})
    if result.returncode != 0:
        raise PipelineError(f"training exited with status {result.returncode}; logs are in {run_dir}/logs.",
                            "read the first error in the rank logs above.")
    return spec
