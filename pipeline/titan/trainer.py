"""torchtitan's Trainer with what this pipeline adds: metrics.jsonl, a recorded first batch,
and a safetensors copy of the model weights in every checkpoint.

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
from torchtitan.components.checkpoint import MODEL
from torchtitan.components.metrics import MetricsProcessor
from torchtitan.tools.logging import logger
from torchtitan.trainer import Trainer

from pipeline.run import rundir
from pipeline.run.rundir import RunDir
from pipeline.titan import compat

# Wall-clock marks (time.time()) of one rank's start-up, for the time-to-first-step benchmark:
# training.entry sets entry/imported/built, the checkpointer sets loaded, step 1 writes the file.
TIMINGS: dict[str, float] = {}


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
        flops_per_token: int = 0
        """Qwen3Arch.flops_per_token(seq_len): the same count whatever path implements the model
        (0: the model config's own get_nparams_and_flops)."""

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.gpu_peak_flops = config.peak_flops_per_rank or measure_cpu_peak_flops()
        self.is_writer = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        self.world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1

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
            with open(self.config.jsonl_path, "a") as handle:
                handle.write(json.dumps(record) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            if step == 1:
                print(f"step-1 loss: {global_avg_loss:.6f}", flush=True)
                if TIMINGS:
                    Path(self.config.jsonl_path).with_name(rundir.TIMINGS).write_text(
                        json.dumps({**TIMINGS, "step1": record["time"]}) + "\n")


class WeightsCheckpointManager(compat.checkpoint_manager_base()):
    """torchtitan's DCP checkpointer that also writes step-N/model_weights.safetensors (see
    pipeline.run.rundir.WEIGHTS): renamed into place after DCP's .metadata, so a step with it is a
    complete checkpoint; a kill between the two is repaired when that step is resumed."""

    @dataclass(kw_only=True, slots=True)
    class Config(compat.checkpoint_manager_base().Config):
        pass

    def after_save(self, step: int) -> None:
        self._save_weights(step)

    def after_load(self, step: int, loaded: bool) -> None:
        if loaded and step >= 0 and not (Path(self.step_folder(step)) / rundir.WEIGHTS).exists():
            # Killed after DCP finished this step but before its weights file: the resumed
            # run may never save this step again (e.g. it was the last), so write it now.
            self._save_weights(step)
        TIMINGS["loaded"] = time.time()

    @torch.no_grad()
    def _save_weights(self, step: int) -> None:
        from torch.distributed.tensor import DTensor

        rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
        full = {}
        # Not torch's get_model_state_dict: it maps keys back to parameters by name and fails on the
        # keys torchtitan's state-dict hooks make (fused wqkv split into wq/wk/wv). torchtitan's own
        # ModelWrapper gives the canonical keys; each DTensor is gathered in the same (sorted) order
        # on every rank.
        for key, value in sorted(self.states[MODEL].state_dict().items()):
            if isinstance(value, DTensor):
                value = value.full_tensor()
            if rank0:
                full[key] = value.detach().to("cpu", copy=True).contiguous()
        if rank0:
            directory = Path(self.step_folder(step))
            directory.mkdir(parents=True, exist_ok=True)
            tmp = directory / f".{rundir.WEIGHTS}.tmp"
            save_file(full, str(tmp), metadata={"format": "pt", "step": str(step), "keys": "torchtitan"})
            os.replace(tmp, directory / rundir.WEIGHTS)
            logger.info(f"Saved the model weights of step {step} to {directory / rundir.WEIGHTS}")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()


class PipelineTrainer(Trainer):
    """Saves every rank's first batch so any later check can recompute the step-1 loss, and, when
    asked (`record_plan`), what the rank really runs: its parallel layout and step 1 (plan_probe)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        run_dir: str = ""
        record_plan: bool = False
        """Write <run dir>/plan/rank<N>.json: layout after parallelisation, module I/O and collectives of step 1."""

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
        self._truncate_metrics_after_checkpoint()
        result = super().train()
        # torchtitan saves only after a step (enable_first_step_checkpoint means after step 1),
        # so STEPS=0 would leave no checkpoint: save the loaded weights as step 0.
        if self.config.training.steps == 0 and self.step == 0:
            self.checkpointer.save(0, last_step=True)
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
