"""What each torchrun rank runs: `python -m pipeline.training.entry <run dir>/run.json`.

Applies the torchtitan glue for the target, turns the RunSpec into a torchtitan
Trainer.Config (the one place settings map onto torchtitan's fields; TITAN_ARGS then apply
over it through torchtitan's own parser), and runs torchtitan's trainer as `torchtitan.train` does.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

ENTERED = time.time()

from pipeline.run import rundir
from pipeline.run.spec import RunSpec
from pipeline.titan import compat
from pipeline.training import dataset

MEMORY_KIND = {"cpu": "peak RSS (CPU)", "cuda": "CUDA reserved", "trn2": "HBM reserved"}


def _activation_checkpoint(kind: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[kind]


def build_config(spec: RunSpec):
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import CommConfig, DebugConfig
    from torchtitan.config.override import OverrideConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader

    from pipeline.models import registry
    from pipeline.titan.trainer import JsonlMetricsProcessor, PipelineTrainer, WeightsCheckpointManager

    s = spec.settings
    run_dir = Path(spec.run_dir)
    dataset_name = dataset.register(dataset.DataSource(spec.data_kind, s.dataset, spec.data_file))
    model_spec = registry.get(spec.path).build(spec)
    config = PipelineTrainer.Config(
        run_dir=str(run_dir),
        record_plan=spec.record_plan,
        model_spec=model_spec,
        hf_assets_path=spec.source_dir,
        dump_folder=str(run_dir),
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.arch.vocab_size),
        metrics=JsonlMetricsProcessor.Config(
            log_freq=1,
            enable_tensorboard=s.tensorboard,
            jsonl_path=str(run_dir / rundir.METRICS),
            peak_flops_per_rank=spec.peak_flops_per_rank or 0.0,
            flops_per_token=spec.arch.flops_per_token(s.seq_len),
            memory_kind=MEMORY_KIND[spec.target],
            disable_color_printing=True,
        ),
        dataloader=HuggingFaceTextDataLoader.Config(
            dataset=dataset_name, infinite=True
        ),
        optimizer=default_adamw(lr=s.lr, weight_decay=0.0),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=s.warmup_steps, decay_type="linear"),
        training=TrainingConfig(
            local_batch_size=s.local_batch_size,
            seq_len=s.seq_len,
            steps=s.steps,
            max_norm=s.max_norm,
            dtype="float32",
            mixed_precision_param=s.dtype,
            disable_cuda_graphs=True,
        ),
        parallelism=ParallelismConfig(
            data_parallel_shard_degree=s.data_parallel_shard,
            tensor_parallel_degree=s.tensor_parallel,
            enable_sequence_parallel=s.sequence_parallel,
        ),
        checkpoint=WeightsCheckpointManager.Config(
            enable=True,
            folder="checkpoint",
            interval=s.checkpoint_interval,
            initial_load_path=spec.source_dir,
            initial_load_in_hf=True,
            initial_load_model_only=True,
            last_save_model_only=False,
            keep_latest_k=s.keep_latest_k,
        ),
        activation_checkpoint=_activation_checkpoint(s.activation_checkpoint),
        compile=CompileConfig(enable=s.compile, backend=s.compile_backend),
        comm=CommConfig(init_timeout_seconds=300, train_timeout_seconds=300),
        debug=DebugConfig(seed=s.seed, deterministic=spec.target == "cpu"),
        override=OverrideConfig(imports=list(spec.overrides)),
    )
    return compat.apply_titan_args(config, spec.titan_args)


def _die_with_torchrun() -> None:
    # torchrun starts each rank in its own session, so kill -9 of the launch's process group
    # (or of torchrun) leaves the ranks running, still writing checkpoints and metrics under the
    # run dir while the user re-runs the same command. Tie each rank's life to torchrun's.
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import os
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # torchrun died before the line above
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_torchrun()
    spec = RunSpec.load(argv[0])
    compat.apply(spec.target)

    import torch
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    from pipeline.titan.trainer import TIMINGS

    TIMINGS.update(entry=ENTERED, imported=time.time())
    trainer = build_config(spec).build()
    TIMINGS["built"] = time.time()
    try:
        trainer.train()
    finally:
        trainer.close()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Run finished")


if __name__ == "__main__":
    main()
