"""What each torchrun rank runs: `python -m pipeline.training.entry <run dir>/run.json`.

Applies the torchtitan glue for the target, checks the run's override.imports against the model
(here, where torchtitan is imported anyway, so the launcher never imports it), turns the RunSpec
into a torchtitan Trainer.Config (the one place settings map onto torchtitan's fields; TITAN_ARGS
then apply over it through torchtitan's own parser), and runs torchtitan's trainer as
`torchtitan.train` does. A PipelineError stops the rank with its one line recorded in the run
dir (failure.json), which the launcher reports as its own.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path

ENTERED = time.time()

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.run import diskspace, rundir
from pipeline.run.spec import RunSpec
from pipeline.titan import api, patches
from pipeline.titan.args import apply_titan_args
from pipeline.data import chat, dataset, preference

MEMORY_KIND = {"cpu": "peak RSS (CPU)", "cuda": "CUDA reserved", "trn2": "HBM reserved"}


def _activation_checkpoint(kind: str):
    from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

    return {"none": None, "selective": SelectiveAC.Config(), "full": FullAC.Config()}[kind]


def _tokenizer(spec: RunSpec):
    """TrainSettings.tokenizer: the source's own (hf_assets_path) or torchtitan's test tokenizer."""
    from pipeline.titan.tokenizer import DirectoryTokenizer
    from pipeline.titan import assets

    return DirectoryTokenizer.Config(directory=assets.tokenizer_dir(spec.settings.tokenizer, spec.source_dir))


def build_config(spec: RunSpec):
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw
    from torchtitan.config import CompileConfig, ParallelismConfig
    from torchtitan.config.configs import CommConfig, DebugConfig
    from torchtitan.config.override import OverrideConfig

    from pipeline.models import registry
    from pipeline.titan import model_spec
    from pipeline.titan.trainer import JsonlMetricsProcessor, PipelineTrainer, WeightsCheckpointManager

    s = spec.settings
    run_dir = Path(spec.run_dir)
    source = dataset.DataSource(spec.data_kind, s.dataset, spec.data_file, spec.data_format)
    trainer, method = PipelineTrainer, {}
    if spec.data_format == "preference":  # DPO: its trainer's step and its settings
        from pipeline.titan.dpo import PreferenceTrainer

        trainer, method = PreferenceTrainer, {"dpo_beta": s.dpo_beta, "dpo_loss": s.dpo_loss}
    path = registry.get(spec.path)
    model = model_spec.trainer_fields(path.build(spec), trainer.Config)
    config = trainer.Config(
        **method,
        run_dir=str(run_dir),
        record_plan=spec.record_plan,
        **model,
        hf_assets_path=spec.source_dir,
        tokenizer=_tokenizer(spec),
        dump_folder=str(run_dir),
        loss=CrossEntropyLoss.Config(global_vocab_size=spec.arch.vocab_size),
        metrics=JsonlMetricsProcessor.Config(
            log_freq=1,
            enable_tensorboard=s.tensorboard,
            enable_wandb=s.wandb,
            jsonl_path=str(run_dir / rundir.METRICS),
            peak_flops_per_rank=spec.peak_flops_per_rank or 0.0,
            flops_per_token=spec.arch.flops_per_token(s.seq_len),
            memory_kind=MEMORY_KIND[spec.target],
            eval_freq=s.eval_every if spec.eval_file else 0,
            disable_color_printing=True,
        ),
        dataloader=_dataloader(source),
        validator=_validator(spec),
        optimizer=default_adamw(lr=s.lr, weight_decay=0.0),
        lr_scheduler=LRSchedulersContainer.Config(warmup_steps=s.warmup_steps, decay_type="linear"),
        training=api.training_config(
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
            folder=rundir.CHECKPOINT,  # under dump_folder, the run directory
            run_dir=str(run_dir),
            interval=s.checkpoint_interval,
            initial_load_path=spec.source_dir,
            initial_load_in_hf=True,
            initial_load_model_only=True,
            last_save_model_only=False,  # the last step keeps its optimizer state; the HF save goes beside it
            export_dtype=s.export_dtype,
            tied_embeddings=spec.arch.tie_word_embeddings,
            keep_latest_k=s.keep_latest_k,
            lora_rank=s.lora_rank,
            lora_alpha=s.lora_alpha,
            kv_heads=spec.arch.num_key_value_heads,
            lora_names=path.lora.names if path.lora else "titan",
        ),
        activation_checkpoint=_activation_checkpoint(s.activation_checkpoint),
        compile=CompileConfig(enable=s.compile, backend=s.compile_backend),
        comm=CommConfig(init_timeout_seconds=300, train_timeout_seconds=300),
        debug=DebugConfig(seed=s.seed, deterministic=spec.target == "cpu"),
        override=OverrideConfig(imports=list(spec.overrides)),
    )
    return _with_labelled_head(apply_titan_args(config, spec.titan_args), spec)


def _with_labelled_head(config, spec: RunSpec):
    """The LM head and loss only on labelled positions (titan.labelled_loss), decided on the final config (after
    TITAN_ARGS), where it can run and the loss is still the cross-entropy set above."""
    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.tools.logging import logger

    from pipeline.titan import labelled_loss

    if type(config.loss) is not CrossEntropyLoss.Config:
        return config
    p = config.parallelism
    why_not = labelled_loss.applies(target=spec.target, compiled=config.compile.enable, tensor_parallel=p.tensor_parallel_degree,
                                    other_parallel=max(p.context_parallel_degree, p.pipeline_parallel_degree),
                                    dpo=spec.data_format == "preference")
    logger.info(f"LM head and loss: {'on labelled positions only' if why_not is None else f'on every position ({why_not})'}")
    if why_not is None:
        config.loss = labelled_loss.LabelledTokensLoss.Config(loss_fn=config.loss)
    return config


def _dataloader(source: dataset.DataSource, name: str | None = None):
    if source.format == "preference":
        return preference.dataloader_config(source.file)
    if source.format == "chat":
        return chat.dataloader_config(source.file)
    return api.text_dataloader(source, dataset.register(source, name))


def _validator(spec: RunSpec):
    """torchtitan's Validator on the held-out file (spec.eval_file): the same loader as training,
    the first eval_steps batches each time, so successive eval losses compare."""
    from torchtitan.components.validate import Validator

    if not spec.eval_file:
        return Validator.Config()
    held = dataset.DataSource("file", spec.eval_file, spec.eval_file, spec.data_format)
    if spec.data_format == "preference":
        from pipeline.titan.dpo import PreferenceValidator

        Validator = PreferenceValidator  # torchtitan's validator, scoring pairs with the DPO loss
    return Validator.Config(enable=True, freq=spec.settings.eval_every, steps=spec.settings.eval_steps,
                            dataloader=_dataloader(held, name=dataset.EVAL_NAME))


def _die_with_torchrun() -> None:
    # torchrun starts each rank in its own session, so kill -9 of the launch's process group
    # (or of torchrun) leaves the ranks running, still writing checkpoints and metrics under the
    # run dir while the user re-runs the same command. Tie each rank's life to torchrun's.
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # torchrun died before the line above
        os._exit(1)


def record_memory(spec: RunSpec, rank: int, peak_gib: float) -> None:
    """Every rank's peak memory, as the metrics read it (JsonlMetricsProcessor.run_peak_memory_gib:
    the process's peak RSS on CPU, the allocator's peak elsewhere, after torch.neuron.synchronize()
    on trn2), beside the run's estimate (pipeline.training.memory, run.json's `memory`; on CPU plus
    the process itself), in memory.json (rank 0 writes it)."""
    import json

    import torch

    from pipeline.fsutil import atomic_write_text
    from pipeline.training import memory

    peak = int(peak_gib * memory.GIB)  # 0 where the device reports nothing
    peaks = [peak]
    if torch.distributed.is_initialized():
        peaks = [None] * torch.distributed.get_world_size()
        torch.distributed.all_gather_object(peaks, peak)
    if rank == 0 and spec.memory:
        parts = dict(spec.memory["parts_gib"])
        if spec.target == "cpu":
            parts["process"] = memory.CPU_PROCESS_GIB
        total = sum(parts.values())
        record = {"kind": MEMORY_KIND[spec.target], "peak_gib_per_rank": [round(p / memory.GIB, 3) for p in peaks],
                  "estimate_gib_per_rank": {**{k: round(v, 3) for k, v in parts.items()}, "total": round(total, 3)},
                  "peak_over_estimate": round(max(peaks) / memory.GIB / total, 3)}
        atomic_write_text(rundir.RunDir(Path(spec.run_dir)).memory, json.dumps(record, indent=2) + "\n")


def check_overrides(spec: RunSpec, rank: int) -> None:
    """Every override.imports entry against the model's config tree, before anything is built
    (pipeline.models.override_check); rank 0 prints the summary and the warnings."""
    if not spec.nki:  # the nki path's plan; the CPU overrides alone match what they should by construction
        return
    from pipeline.models import override_check

    report = override_check.check_spec(spec)
    if rank == 0:
        for warning in report.warnings:
            print(f"warning: {warning}", file=sys.stderr, flush=True)
        print(report.summary(), flush=True)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    _die_with_torchrun()
    spec = RunSpec.load(argv[0])
    rank = int(os.environ.get("RANK", "0"))
    try:
        run(spec, rank)
    except PipelineError as err:
        rundir.RunDir(Path(spec.run_dir)).record_failure(rank, err.problem, err.fix or "")
        print(f"error: {err}", file=sys.stderr, flush=True)
        sys.exit(2)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        full = diskspace.full_disk_error(err)
        if full is None:
            raise
        problem, fix = diskspace.full_disk_failure(full, Path(spec.run_dir))
        # failure.json is a few bytes, and the rank's stderr (torchrun's --tee log) is on that disk too:
        # either may fail now; the launcher then names the full disk itself (pipeline.launch.launcher._failure).
        with contextlib.suppress(OSError):
            rundir.RunDir(Path(spec.run_dir)).record_failure(rank, problem, fix)
        with contextlib.suppress(OSError):
            print(f"error: {problem} Fix: {fix}", file=sys.stderr, flush=True)
        os._exit(2)  # an exit flushing a stream on the full disk would fail again
    _exit_skipping_teardown()


def _exit_skipping_teardown() -> None:
    # Everything a rank makes is written (atomically), its process group destroyed and the
    # metrics logger closed by now. Interpreter teardown then runs the C++ destructors of native
    # threads (torch, gloo, pyarrow); on 2-core CI machines one rank of a finished run now and then
    # aborted there, after "Run finished" ("terminate called without an active exception",
    # SIGABRT or SIGSEGV; seen in about one of 10 pytest sessions, never in 30 direct runs), and
    # torchrun then reported the finished run as failed. A finished rank loses nothing by skipping it
    # once Python's own exit handlers have run (logging's shutdown, the nki op counts): there is no
    # public call for that, atexit._run_exitfuncs is the one CPython's exit runs itself.
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run(spec: RunSpec, rank: int) -> None:
    patches.apply(spec.target)

    import torch
    from torchtitan.tools.logging import init_logger, logger

    init_logger()
    logger.info(f"torchtitan API: {api.variant_of_imported()}")  # which of the two (titan.api) this rank runs on
    from pipeline.titan.trainer import PipelineTrainer  # torchtitan's Trainer imported: the "imported" mark

    timings = {"entry": ENTERED, "imported": time.time(), "threads": torch.get_num_threads()}
    if os.environ.get(envvars.LAUNCHED_AT):  # set by the train stage as it starts torchrun
        timings["launched"] = float(os.environ[envvars.LAUNCHED_AT])
    check_overrides(spec, rank)
    dataset.open_in_rank(dataset.DataSource(spec.data_kind, spec.settings.dataset, spec.data_file, spec.data_format))
    if spec.eval_file:
        dataset.open_in_rank(dataset.DataSource("file", spec.eval_file, spec.eval_file, spec.data_format))
    if spec.settings.wandb:  # torchtitan's WandBLogger reads these; a user's own values win
        os.environ.setdefault("WANDB_PROJECT", spec.settings.wandb_project)
        os.environ.setdefault("WANDB_RUN_NAME", f"{spec.model_key}/{Path(spec.run_dir).name}")
    trainer: PipelineTrainer = build_config(spec).build()
    trainer.timings.update(timings, built=time.time())  # before training: the checkpointer's load adds "loaded"
    try:
        trainer.train()
    finally:
        trainer.close()
    record_memory(spec, rank, trainer.metrics_processor.run_peak_memory_gib())
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    logger.info("Run finished")


if __name__ == "__main__":
    main()
