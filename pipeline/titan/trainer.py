"""torchtitan's Trainer with what this pipeline adds: metrics.jsonl, a recorded first batch,
and the last step's model in Hugging Face safetensors, through torchtitan's HF writer (what export links).

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

from pipeline.console import StepClock, step_line
from pipeline.fsutil import atomic_write_text, fsync_file, give_ordinary_modes
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
    total_steps = 0  # the run's training.steps (PipelineTrainer sets it, TITAN_ARGS applied): the step line's N
    clock: StepClock | None = None
    timings: dict[str, float] | None = None  # PipelineTrainer.timings: step 1 writes them (timings.json)
    step_metrics = None  # a trainer's own metrics of the step being logged (titan.dpo: rewards/…), a callable

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
        if self.step_metrics is not None:
            own = self.step_metrics()
            record.update(own)
            extra_metrics = {**(extra_metrics or {}), **own}
        super().log(step, global_avg_loss, global_max_loss, grad_norm, extra_metrics)
        if self.is_writer and self.config.jsonl_path:
            if getattr(self, "held_record", None):  # no validation came for it (TITAN_ARGS changed the validator)
                self._write(self.held_record)
                self.held_record = None
            if self.config.eval_freq and (step == 1 or step % self.config.eval_freq == 0):
                self.held_record = record  # torchtitan's validator runs right after this step's log
            else:
                self._write(record)
            self.clock = self.clock or StepClock(self.total_steps)
            eta = self.clock.eta(step, time.perf_counter(), record["step_time_s"])
            print(step_line(step, self.total_steps, global_avg_loss, tokens_per_s, eta), flush=True)
            if step == 1:
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
            self._write({**record, "eval_loss": float(loss), **(extra_metrics or {})})
            print(f"step {step}: eval loss (held out) {float(loss):.6f}", flush=True)


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
    """torchtitan's DCP checkpointer that, at a run's last step, also saves the model alone in
    Hugging Face safetensors through torchtitan's own HF writer (dcp_save(to_hf=True): the path's
    state-dict adapter, DCP's HuggingFaceStorageWriter, consolidation), in the export dtype, into
    step-N/hf (pipeline.run.rundir.HF_WEIGHTS): what export links. The full DCP save of that step
    stays beside it, so a finished run continued with more STEPS resumes with its optimizer state.
    Other steps are DCP only; a run cut short between DCP and the HF save gets it when resumed
    (PipelineTrainer.train)."""

    @dataclass(kw_only=True, slots=True)
    class Config(accessors.checkpoint_manager_base().Config):
        lora_rank: int = 0
        lora_alpha: float = 16.0
        kv_heads: int = 0  # the model's, for LoRA's merge into the fused wqkv's wq/wk/wv
        lora_names: str = "titan"  # the adapters' names in the model: a key of pipeline.titan.lora.NAMES
        run_dir: str = ""
        """The run's directory (pipeline.run.rundir.RunDir): where the digests, saves.jsonl and the HF
        saves' record live. Given, not derived from a step folder, so the checkpoint folder's place in
        the run directory is RunDir's alone to know."""
        tied_embeddings: bool = False
        """The model's lm_head is its embedding. When the source checkpoint (initial_load_path) stores
        it anyway (some Hub repos do), the HF save keeps it too, where torchtitan's adapters drop it,
        so that the export has the source's keys."""

    lora: tuple[int, float, int] | None = None  # (rank, alpha, kv heads) of a LoRA run, from the config
    adapter_names = None  # pipeline.titan.lora.AdapterNames of a LoRA run
    timings: dict[str, float] | None = None  # PipelineTrainer.timings: after_load adds "loaded"

    def __init__(self, config: Config, **kwargs):
        super().__init__(config, **kwargs)
        self.run = RunDir(Path(config.run_dir))
        if config.lora_rank > 0:
            from pipeline.titan import lora

            self.lora = (config.lora_rank, config.lora_alpha, config.kv_heads)
            self.adapter_names = lora.NAMES[config.lora_names]
        self.stored_tied_head = config.tied_embeddings and _stores_lm_head(config.initial_load_path)

    def before_save(self, step: int, last_step: bool) -> None:
        release_free_memory()  # what the steps keep for themselves is not needed while saving
        self._save_started = time.perf_counter()

    def after_save(self, step: int, last_step: bool) -> None:
        dcp_s = time.perf_counter() - self._save_started
        if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
            # DCP's rank 0 wrote .metadata: its digest is what a resume checks before unpickling it
            # (first, so a kill right after the save leaves the step resumable)
            self.run.record_dcp_digest(step)
        hf_s = None
        if last_step:
            started = time.perf_counter()
            self.save_hf(step)
            hf_s = time.perf_counter() - started
        self._record_save(step, dcp_s, hf_s)
        release_free_memory()  # nor is what the save allocated, by the steps that follow

    def _record_save(self, step: int, dcp_s: float, hf_s: float | None) -> None:
        """One line per save in saves.jsonl (rank 0): what the HF save costs beside DCP."""
        if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
            return
        directory = Path(self.step_folder(step))
        hf = directory / rundir.HF_WEIGHTS
        record = {"step": step, "dcp_s": dcp_s, "hf_s": hf_s,
                  "dcp_bytes": sum(p.stat().st_size for p in directory.iterdir() if p.is_file()),
                  "hf_bytes": sum(p.stat().st_size for p in hf.iterdir() if p.is_file()) if hf.is_dir() else 0}
        with open(self.run.saves, "a") as handle:
            handle.write(json.dumps(record) + "\n")

    reference = None  # titan.dpo.Reference of a DPO run: the starting weights, taken once they are loaded

    def after_load(self, step: int, loaded: bool) -> None:
        release_free_memory()  # the load's buffers (a whole checkpoint read and converted) are gone
        if self.reference is not None:
            self._take_reference(step)
        if self.timings is not None:
            self.timings["loaded"] = time.time()

    @torch.no_grad()
    def _take_reference(self, step: int) -> None:
        """A fresh start loaded the source: those are the reference. A resumed run loaded step N: the source is
        loaded once more for the reference, then step N's weights are put back."""
        if step <= 0 or self.reference.lora:
            self.reference.take()
            return
        self.reference.take(load_first=self.load_starting_weights)
        logger.info(f"DPO: resumed at step {step}; the reference is the source's weights, loaded again")

    def hf_dtype(self, step: int) -> str | None:
        """The dtype step-N/hf was saved in, None when the step has no (readable) HF save."""
        return self.run.hf_weights_dtype(step)

    @torch.no_grad()
    def save_hf(self, step: int) -> None:
        """The model alone, in the export dtype, through torchtitan's HF writer: every rank writes its
        own shards (DCP), which are consolidated into HF's model-0000x-of-0000y files and index. Written
        into step-N/.hf.tmp and renamed to step-N/hf once every rank is done (no half-written HF save
        is ever named hf); DCP's per-rank shards are deleted after consolidation."""
        import shutil

        distributed = torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        directory = Path(self.step_folder(step))
        final, tmp = directory / rundir.HF_WEIGHTS, directory / f".{rundir.HF_WEIGHTS}.tmp"
        # torchtitan's ModelWrapper gives the canonical keys (fused wqkv split into wq/wk/wv by its hooks).
        state = list(self.states[MODEL].state_dict().items())
        adapters = None
        if self.lora is not None:  # LoRA: the merged weights, a plain model for export and verify
            from pipeline.titan import lora

            adapters = lora.adapter_tensors(state, self.adapter_names)  # and the adapters alone, for `export --adapter`
            state = lora.merged(state, *self.lora, self.adapter_names)
        dtype = self.export_dtype
        state = {k: v.to(dtype) if v.is_floating_point() and v.dtype != dtype else v for k, v in state}
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # what a save cut short left
        if distributed:
            torch.distributed.barrier()
        self.save_model_in_hf(state, str(tmp), _StoredTiedHead if self.stored_tied_head else None)
        del state
        if distributed:
            torch.distributed.barrier()
        hashes = self._hash_shards(tmp, rank, torch.distributed.get_world_size() if distributed else 1)
        if rank == 0:
            atomic_write_text(tmp / rundir.HF_HASHES, json.dumps(hashes, indent=1, sort_keys=True) + "\n")
            shutil.rmtree(tmp / rundir.HF_SHARDED, ignore_errors=True)
            if adapters is not None:  # before the weights: a step with weights has its adapters too
                save_file(dict(adapters), str(directory / f".{rundir.ADAPTERS}.tmp"), metadata={"format": "pt"})
                give_ordinary_modes(directory / f".{rundir.ADAPTERS}.tmp")
                os.replace(directory / f".{rundir.ADAPTERS}.tmp", directory / rundir.ADAPTERS)
            # A resumed run saving its last step again (another dtype): the old save goes only once the new is whole.
            aside = directory / f".{rundir.HF_WEIGHTS}.old"
            if final.exists():
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
            os.replace(tmp, final)
            fsync_file(directory)  # the rename itself
            shutil.rmtree(aside, ignore_errors=True)
            logger.info(f"Saved the model of step {step} in HF safetensors to {final}")
        if distributed:
            torch.distributed.barrier()


    @staticmethod
    def _hash_shards(directory: Path, rank: int, world: int) -> dict[str, dict]:
        """Every shard's sha256, size and mtime, each rank hashing (and fsyncing) its share: the reference
        export and verify check the saved weights against (RunDir.hf_hashes), and export's manifest's.
        First each shard of the share gets save_pretrained's {"format": "pt"} header metadata, which torch's
        consolidation does not write (transformers' loaders read it), so that export can link them."""
        from pipeline.checkpoint import manifest, stream

        shards = sorted(directory.glob("*.safetensors"))
        for i, shard in enumerate(shards):
            if i % world == rank and not stream.has_pt_format(shard):
                marked = shard.with_name(f".{shard.name}.pt")
                stream.copy_with_metadata(shard, marked, stream.PT_METADATA)
                os.replace(marked, shard)
        mine = {p.name: {"sha256": manifest.sha256(p), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                for i, p in enumerate(shards) if i % world == rank}
        # torch's consolidation does not fsync what it writes: on disk before the save is named hf.
        # Hidden names are other ranks' marked copies, renamed over their shards meanwhile (not ours to fsync).
        rest = [p for p in directory.iterdir()
                if p.is_file() and p.suffix != ".safetensors" and not p.name.startswith(".")] if rank == 0 else []
        for path in [directory / name for name in mine] + rest:
            fsync_file(path)
        if world == 1:
            return mine
        every: list = [None] * world
        torch.distributed.all_gather_object(every, mine)
        return {name: digest for part in every for name, digest in part.items()}


class _StoredTiedHead:
    """The run's state-dict adapter, plus a tied lm_head.weight (the embedding) for a source that
    stores one: torchtitan's adapters drop it, the export must have the source's keys."""

    def __init__(self, adapter):
        self.adapter = adapter
        mapping = adapter.fqn_to_index_mapping
        if mapping and EMBEDDING in mapping:
            mapping = {**mapping, LM_HEAD: mapping[EMBEDDING]}
        self.fqn_to_index_mapping = mapping

    def to_hf(self, state_dict):
        converted = self.adapter.to_hf(state_dict)
        if LM_HEAD not in converted and EMBEDDING in converted:
            # its own storage: safetensors refuses to save two names of one tensor
            converted[LM_HEAD] = converted[EMBEDDING].clone()
        return converted


EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


def _stores_lm_head(source: str | None) -> bool:
    from pipeline.checkpoint import hf_dir

    return bool(source) and LM_HEAD in hf_dir.read_tensors(Path(source))


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
        self.metrics_processor.total_steps = self.config.training.steps
        if getattr(self.checkpointer, "lora", None):
            from pipeline.titan import lora

            trainable = lora.freeze_base(self.model_parts, self.checkpointer.adapter_names)
            logger.info(f"LoRA: {trainable:,} adapter parameters train, the rest is frozen")
        self.metrics_processor.step_metrics = self._head_metrics

    def _head_metrics(self) -> dict[str, int]:
        """lm_head_positions: the positions this rank's LM head ran on in the step (titan.labelled_loss)."""
        from pipeline.titan.labelled_loss import LabelledTokensLoss

        if not isinstance(self.loss_fn, LabelledTokensLoss):
            return {}
        return {"lm_head_positions": self.loss_fn.take_head_positions()}

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
        elif self.step == self.config.training.steps and self.step in RunDir(Path(self.config.dump_folder)).dcp_steps() \
                and self.checkpointer.hf_dtype(self.step) != str(self.checkpointer.export_dtype).removeprefix("torch."):
            # Resumed at the last step, whose save was cut short after DCP or whose HF save is in another
            # export dtype than this run asks for: nothing trains, so nothing saves again; save it now.
            self.checkpointer.save_hf(self.step)
        return result

    def _truncate_metrics_after_checkpoint(self) -> None:
        # A resumed run repeats the steps after its last checkpoint: drop their old lines.
        path = Path(self.config.metrics.jsonl_path) if self.config.metrics.jsonl_path else None
        if path is None or not path.exists() or torch.distributed.get_rank() != 0:
            return
        run = RunDir(Path(self.config.dump_folder))
        torn = run.drop_torn_metrics_tail()  # the launcher dropped it already; not a rank started by launch files
        if torn:
            logger.warning(torn.removeprefix("warning: "))
        resumed = self._resume_step()
        steps = [(line, run.metric_step(line)) for line in path.read_text(errors="replace").splitlines() if line.strip()]
        keep = [line for line, step in steps if step is not None and step <= resumed]
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
        give_ordinary_modes(tmp)
        os.replace(tmp, directory / f"rank{rank}.safetensors")
        logger.info(f"Saved the first batch of rank {rank} to {directory}")
