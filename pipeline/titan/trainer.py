"""torchtitan's Trainer with what this pipeline adds: metrics.jsonl, a recorded first batch,
and a safetensors copy of the model weights in a run's last checkpoint (what export reads).

All are torchtitan components (Configurable subclasses), so they are built the way
torchtitan builds its own; nothing in the training loop is rewritten.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from torchtitan.components.checkpointer import MODEL
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from pipeline.run import rundir
from pipeline.run.rundir import RunDir
from pipeline.titan import accessors


def measure_cpu_peak_flops(size: int = 1024, repeats: int = 5) -> float:
    """Best fp32 matmul rate of this process's threads: the honest CPU 'peak' for MFU."""
    a, b = torch.randn(size, size), torch.randn(size, size)
    a @ b
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - start)
    return 2 * size**3 / best


class JsonlMetricsProcessor(MetricsProcessor):
    """Adds one JSON object per logged step to metrics.jsonl and uses the target's real peak."""

    @dataclass(kw_only=True, slots=True)
    class Config(MetricsProcessor.Config):
        jsonl_path: str = ""
        peak_flops_per_rank: float = 0.0
        memory_kind: str = "device"
        eval_freq: int = 0
        """The validator's freq when it runs (0: off): a step it validates writes its metrics.jsonl
        line once the eval loss is known, with that loss in it (eval_loss)."""
        flops_per_token: int = 0
        """Qwen3Arch.flops_per_token(seq_len): the same count whatever path implements the model
        (0: the model config's own get_nparams_and_flops)."""

    logged_peak_memory_gib = 0.0  # the largest peak any logged step read (log() raises it per instance)
    timings: dict[str, float] | None = None  # PipelineTrainer.timings: step 1 writes them (timings.json)

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.gpu_peak_flops = config.peak_flops_per_rank or measure_cpu_peak_flops()
        self.is_writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

    def run_peak_memory_gib(self) -> float:
        """The run's peak memory per the device memory monitor, the one every read goes through (on trn2
        titan.patches' SynchronizedMemoryMonitor: torch.neuron.synchronize() first): the largest logged step's,
        or one more read now if larger (the monitor's peak restarts at every log, so a read at the end
        alone would see only what ran after the last logged step)."""
        return max(self.logged_peak_memory_gib, self.device_memory_monitor.get_peak_stats().max_reserved_gib)

    def throughput(self, elapsed: float) -> tuple[float, float]:
        """(tokens/s of the whole job, tokens/s per rank). ntokens_since_last_log is this rank's own
        batch, which every rank of its TP/CP/PP group shares: per rank it is divided by the non-data-
        parallel size, exactly as torchtitan's MetricsProcessor.log computes `tps`; the job's rate is
        that per-rank rate times the world size (= this rank's tokens × data-parallel ranks / s)."""
        per_rank = self.ntokens_since_last_log / (elapsed * self.parallel_dims.non_data_parallel_size)
        return per_rank * self.world_size, per_rank

    def log(self, step, global_avg_loss, global_max_loss, grad_norm, extra_metrics=None):
        elapsed = time.perf_counter() - self.time_last_log
        memory = self.device_memory_monitor.get_peak_stats()
        self.logged_peak_memory_gib = max(self.logged_peak_memory_gib, memory.max_reserved_gib)
        tokens_per_s, tps_rank = self.throughput(elapsed)
        if self.config.flops_per_token:
            # torchtitan's own console/TensorBoard MFU (super().log) then uses the same count.
            self.num_flops_per_token = self.config.flops_per_token
        flops_per_token = self.num_flops_per_token
        record = {
            "step": step,
            "loss": global_avg_loss,
            "grad_norm": grad_norm,
            "step_time_s": elapsed / self.config.log_freq,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_rank": tps_rank,
            "mfu": 100 * flops_per_token * tps_rank / self.gpu_peak_flops,
            "flops_per_token": flops_per_token,
            "peak_flops_per_rank": self.gpu_peak_flops,
            "memory_gib": memory.max_reserved_gib,
            "memory_kind": self.config.memory_kind,
            "time": time.time(),
        }
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if self.is_writer and self.config.jsonl_path:
            if getattr(self, "held_record", None):  # no validation came for it (TITAN_ARGS changed the validator)
                self._write(self.held_record)
                self.held_record = None
            if self.config.eval_freq and (step == 1 or step % self.config.eval_freq == 0):
                self.held_record = record  # torchtitan's validator runs right after this step's log
            else:
                self._write(record)
            if step == 1:
                print(f"step-1 loss: {global_avg_loss:.6f}", flush=True)
                if self.timings:
                    Path(self.config.jsonl_path).with_name(rundir.TIMINGS).write_text(
                        json.dumps({**self.timings, "step1": record["time"]}) + "\n")


    def _write(self, record: dict) -> None:
        # Written through to the page cache, not fsynced: a killed run keeps every line (the
        # kernel has them), and a line torn by a machine crash is skipped when read back.
        with open(self.config.jsonl_path, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def log_validation(self, loss: float, step: int, extra_metrics=None):
        super().log_validation(loss, step, extra_metrics)  # console and TensorBoard (validation_metrics/loss)
        if self.is_writer and self.config.jsonl_path:
            record = getattr(self, "held_record", None) or {"step": step}
            self.held_record = None
            if record["step"] != step:
                self._write(record)
                record = {"step": step}
            self._write({**record, "eval_loss": float(loss)})


def release_free_memory() -> None:
    """Return the C heap's free memory to the kernel (glibc malloc_trim), between phases.

    The CPU target raises glibc's mmap and trim thresholds (pipeline.run.targets) so the large
    per-step tensors (vocabulary logits) are reused instead of re-faulted every step, which makes
    freed memory stay with the process. That is what the steps want; around the one-off phases
    (loading a checkpoint, saving one) it would add their buffers to the steps' on the peak."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: its allocator keeps no such pool
        pass


class WeightsCheckpointManager(accessors.checkpoint_manager_base()):
    """torchtitan's DCP checkpointer that also writes the model weights as safetensors
    (step-N/model_weights.safetensors, pipeline.run.rundir.WEIGHTS) at a run's last step, the one
    export reads: renamed into place after DCP's .metadata. Other steps are DCP only (the copy
    costs a third of a DCP save with AdamW state); a run cut short between DCP and the weights
    file gets it when resumed (PipelineTrainer.train)."""

    @dataclass(kw_only=True, slots=True)
    class Config(accessors.checkpoint_manager_base().Config):
        lora_rank: int = 0
        lora_alpha: float = 16.0
        kv_heads: int = 0  # the model's, for LoRA's merge into the fused wqkv's wq/wk/wv

    lora: tuple[int, float, int] | None = None  # (rank, alpha, kv heads) of a LoRA run, from the config
    timings: dict[str, float] | None = None  # PipelineTrainer.timings: after_load adds "loaded"

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        if config.lora_rank > 0:
            self.lora = (config.lora_rank, config.lora_alpha, config.kv_heads)

    def before_save(self, step: int, last_step: bool) -> None:
        release_free_memory()  # what the steps keep for themselves is not needed while saving
        self._save_started = time.perf_counter()

    def after_save(self, step: int, last_step: bool) -> None:
        dcp_s = time.perf_counter() - self._save_started
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            # DCP's rank 0 wrote .metadata: its digest is what a resume checks before unpickling it
            # (first, so a kill right after the save leaves the step resumable)
            RunDir(Path(self.step_folder(step)).parent.parent).record_dcp_digest(step)
        weights_s = None
        if last_step:
            started = time.perf_counter()
            self.save_weights(step)
            weights_s = time.perf_counter() - started
        self._record_save(step, dcp_s, weights_s)
        release_free_memory()  # nor is what the save allocated, by the steps that follow

    def _record_save(self, step: int, dcp_s: float, weights_s: float | None) -> None:
        """One line per save in saves.jsonl (rank 0): what the weights copy costs beside DCP."""
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        directory = Path(self.step_folder(step))
        weights = directory / rundir.WEIGHTS
        sizes = {p.name: p.stat().st_size for p in directory.iterdir() if p.is_file()}
        record = {"step": step, "dcp_s": dcp_s, "weights_s": weights_s,
                  "dcp_bytes": sum(v for k, v in sizes.items() if k != rundir.WEIGHTS and not k.startswith(".model")),
                  "weights_bytes": weights.stat().st_size if weights.exists() else 0}
        with open(RunDir(Path(self.step_folder(step)).parent.parent).saves, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    def after_load(self, step: int, loaded: bool) -> None:
        release_free_memory()  # the load's buffers (a whole checkpoint read and converted) are gone
        if self.timings is not None:
            self.timings["loaded"] = time.time()

    def has_weights(self, step: int) -> bool:
        return (Path(self.step_folder(step)) / rundir.WEIGHTS).exists()

    @torch.no_grad()
    def save_weights(self, step: int) -> None:
        """Every rank writes its own FSDP shard of each tensor straight into the file, at the
        offset the header gives it (a Shard(0) shard is a contiguous row range): no gathering,
        all ranks writing at once, as DCP does. Other layouts (TP) are gathered one tensor at a
        time and written by rank 0. Nothing holds more than one full tensor."""
        from torch.distributed.tensor import DTensor

        from pipeline.checkpoint import stream

        distributed = torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        # Not torch's get_model_state_dict: it maps keys back to parameters by name and fails on the
        # keys torchtitan's state-dict hooks make (fused wqkv split into wq/wk/wv). torchtitan's own
        # ModelWrapper gives the canonical keys, in the model's order, the same on every rank.
        state = list(self.states[MODEL].state_dict().items())
        adapters = None
        if self.lora is not None:  # LoRA: the merged weights, a plain model for export and verify
            from pipeline.titan import lora

            adapters = lora.adapter_tensors(state)  # and the adapters alone, for `export --adapter`
            state = lora.merged(state, *self.lora)
        aliases = [_aliases(state) if rank == 0 else None]
        if distributed:
            torch.distributed.broadcast_object_list(aliases, src=0)
        aliases = aliases[0]
        written = [(k, v) for k, v in state if k not in aliases]
        metadata = {"format": "pt", "step": str(step), "keys": "torchtitan", "aliases": json.dumps(aliases)}
        plan = stream.layout([stream.entry_of(k, v) for k, v in written], metadata, rundir.WEIGHTS)
        directory = Path(self.step_folder(step))
        tmp = directory / f".{rundir.WEIGHTS}.tmp"
        if rank == 0:
            directory.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as handle:
                handle.write(plan.header)
                handle.truncate(plan.size)
        if distributed:
            torch.distributed.barrier()
        fd = os.open(tmp, os.O_WRONLY)
        try:
            for key, value in written:
                first_row = _own_rows(value)
                if first_row is not None:  # this rank's Shard(0) rows, in place
                    local = value.to_local()
                    if local.numel():
                        row_bytes = local[0].numel() * local.element_size()
                        stream.pwrite_all(fd, stream.tensor_bytes(local), plan.offsets[key] + first_row * row_bytes, tmp)
                    continue
                full = value.full_tensor() if isinstance(value, DTensor) else value
                if rank == 0:
                    stream.pwrite_all(fd, stream.tensor_bytes(full), plan.offsets[key], tmp)
                del full
            os.fsync(fd)
        finally:
            os.close(fd)
        if distributed:
            torch.distributed.barrier()
        if rank == 0:
            if adapters is not None:  # before the weights: a step with weights has its adapters too
                from safetensors.torch import save_file

                save_file(dict(adapters), str(directory / f".{rundir.ADAPTERS}.tmp"), metadata={"format": "pt"})
                os.replace(directory / f".{rundir.ADAPTERS}.tmp", directory / rundir.ADAPTERS)
            os.replace(tmp, directory / rundir.WEIGHTS)
            logger.info(f"Saved the model weights of step {step} to {directory / rundir.WEIGHTS}")
        if distributed:
            torch.distributed.barrier()


def _own_rows(value) -> int | None:
    """The first row of this rank's shard when `value` is a DTensor split by rows over a 1-D mesh
    of every rank (FSDP's layout), else None (gather it). torch.chunk's split, as DTensor uses."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(value, DTensor) or value.device_mesh.ndim != 1 or tuple(value.placements) != (Shard(0),):
        return None
    if value.device_mesh.size() != torch.distributed.get_world_size():
        return None
    per_rank = -(-value.shape[0] // value.device_mesh.size())
    first = per_rank * value.device_mesh.get_local_rank()
    expected = max(0, min(value.shape[0], first + per_rank) - first)
    if value.to_local().shape[0] != expected:
        raise RuntimeError(f"unexpected shard: {tuple(value.to_local().shape)} rows at {first} of {tuple(value.shape)}")
    return first


def _aliases(state: list[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """A tensor stored under two keys (a tied lm_head is the embedding) is written once, under its
    first key in the model's order: later key → first key. Decided on rank 0, sent to all."""
    from torch.distributed.tensor import DTensor

    first: dict[tuple, str] = {}
    aliases = {}
    for key, value in state:
        local = value.to_local() if isinstance(value, DTensor) else value
        if not local.numel():
            continue
        ident = (local.untyped_storage().data_ptr(), local.storage_offset(), tuple(value.shape), value.dtype)
        if ident in first:
            aliases[key] = first[ident]
        else:
            first[ident] = key
    return aliases


class PipelineTrainer(Trainer):
    """Saves every rank's first batch so any later check can recompute the step-1 loss, and, when
    asked (`record_plan`), what the rank really runs: its parallel layout and step 1 (plan_probe).

    `timings` holds the wall-clock marks (time.time()) of the rank's start-up, for the time-to-first-step
    benchmark: training.entry adds entry/imported/threads/launched/built before training, the checkpointer
    adds loaded, and the metrics processor writes them with step1 to timings.json at step 1."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run_dir: str = ""
        record_plan: bool = False
        """Write <run dir>/plan/rank<N>.json: layout after parallelisation, module I/O and collectives of step 1."""

    def __init__(self, config, **kwargs):
        super().__init__(config, **kwargs)
        self.timings: dict[str, float] = {}
        self.checkpointer.timings = self.metrics_processor.timings = self.timings  # the components that add to them
        if getattr(self.checkpointer, "lora", None):
            from pipeline.titan import lora

            trainable = lora.freeze_base(self.model_parts)
            logger.info(f"LoRA: {trainable:,} adapter parameters train, the rest is frozen")

    def forward_backward_step(self, **kwargs):
        if not self.config.record_plan or self.step != 1 or getattr(self, "_plan_recorded", False):
            return super().forward_backward_step(**kwargs)
        from pipeline.titan import plan_probe

        model = self.model_parts[0]
        record = {"mesh": plan_probe.mesh_record(self.parallel_dims), "layout": plan_probe.layout(model)}
        with plan_probe.StepProbe(model, plan_probe.group_labels(self.parallel_dims),
                                  compiled=record["layout"]["compiled"]) as probe:
            loss = super().forward_backward_step(**kwargs)
        record["step"] = probe.record()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        plan_probe.write(RunDir(Path(self.config.run_dir)).plan / f"rank{rank}.json", record)
        self._plan_recorded = True
        return loss

    def batch_generator(self, data_iterable):
        saved = False
        for input_dict, labels in super().batch_generator(data_iterable):
            # The body runs lazily: self.step is already 1 when step 1 asks for its batch.
            if not saved and self.step == 1:
                self._save_first_batch(input_dict, labels)
            saved = True
            yield input_dict, labels

    def train(self):
        # Before torchtitan's checkpointer unpickles the resume step's .metadata: is it ours?
        RunDir(Path(self.config.dump_folder)).check_resume()
        self._truncate_metrics_after_checkpoint()
        result = super().train()
        # torchtitan saves only after a step (enable_first_step_checkpoint means after step 1),
        # so STEPS=0 would leave no checkpoint: save the loaded weights as step 0.
        if self.config.training.steps == 0 and self.step == 0:
            self.checkpointer.save(0, last_step=True)
        elif self.step == self.config.training.steps and not self.checkpointer.has_weights(self.step) \
                and self.step in RunDir(Path(self.config.dump_folder)).dcp_steps():
            # Resumed at the last step, whose save was cut short after DCP: nothing trains, so
            # nothing saves again; write the weights export reads now.
            self.checkpointer.save_weights(self.step)
        return result

    def _truncate_metrics_after_checkpoint(self) -> None:
        # A resumed run repeats the steps after its last checkpoint: drop their old lines.
        path = Path(self.config.metrics.jsonl_path) if self.config.metrics.jsonl_path else None
        if path is None or not path.exists() or torch.distributed.get_rank() != 0:
            return
        lines = path.read_text().splitlines()
        keep = [line for line in lines if line.strip() and json.loads(line)["step"] <= self._resume_step()]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(line + "\n" for line in keep))
        os.replace(tmp, path)

    def _resume_step(self) -> int:
        return max(RunDir(Path(self.config.dump_folder)).dcp_steps(), default=0)

    def _save_first_batch(self, input_dict, labels) -> None:
        directory = RunDir(Path(self.config.run_dir)).first_batch
        directory.mkdir(parents=True, exist_ok=True)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        tensors = {"labels": labels.contiguous()}
        tensors |= {k: v.contiguous() for k, v in input_dict.items() if isinstance(v, torch.Tensor)}
        tmp = directory / f".rank{rank}.tmp"
        save_file(tensors, str(tmp))
        os.replace(tmp, directory / f"rank{rank}.safetensors")
        logger.info(f"Saved the first batch of rank {rank} to {directory}")
