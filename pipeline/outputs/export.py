"""A run's last complete checkpoint as a Hugging Face checkpoint, <run dir>/export/.

The trainer already wrote the model of a run's last step in HF safetensors, through torchtitan's own
HF writer (step-N/hf: the run's state-dict adapter, DCP's HuggingFaceStorageWriter, the source's
shard layout, the export dtype). Export checks those files against the source checkpoint (keys,
shapes, finite values: nothing is trusted because of where it lies), links them into a temporary
sibling (a copy where the filesystem cannot link), adds config.json (transformers' current form),
the tokenizer files, the model card and manifest.json (last), and renames it into place only when
complete. Asked for a narrower dtype than the run saved (float32 → bfloat16), it casts tensor by
tensor instead; never wider (that precision is gone). DCP's .metadata is a pickle and is never read.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import dtypes
from pipeline.checkpoint import hf_dir, manifest, stream
from pipeline.checkpoint.arch import Qwen3Arch, load_arch
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory
from pipeline.models import registry
from pipeline.run import model_card, rundir
from pipeline.run.rundir import RunDir

SINGLE_FILE = "model.safetensors"  # save_pretrained's name for an unsharded checkpoint (no index)


@dataclass(frozen=True)
class ExportConfig:
    run: RunDir
    dtype: str = "bfloat16"
    step: int | None = None
    force: bool = False
    output: Path | None = None  # default <run dir>/export

    @property
    def target(self) -> Path:
        return Path(self.output) if self.output else self.run.export


@dataclass(frozen=True)
class SavedModel:
    """A run step's HF save, checked against its source: its shards (HF's names) and dtype."""

    step: int
    directory: Path
    shards: list[Path]
    tensors: dict[str, hf_dir.TensorInfo]
    dtype: str  # torch's name

    def names(self) -> dict[Path, str]:
        """Shard → its name in the export: one shard is save_pretrained's single file, with no index."""
        if len(self.shards) == 1:
            return {self.shards[0]: SINGLE_FILE}
        return {shard: shard.name for shard in self.shards}


def saved_model(run: RunDir, step: int | None, source_tensors: dict[str, hf_dir.TensorInfo]) -> SavedModel:
    """The HF save of `step` (default: the last exportable), with the source's keys and shapes and one dtype."""
    step, directory = run.hf_weights(step)
    fix = (f"delete {directory} and rerun the training command; it resumes at step {step} and saves the model again.")
    try:
        shards = hf_dir.shard_files(directory)
        saved = hf_dir.read_tensors(directory)
    except PipelineError as err:
        raise PipelineError(f"step {step}'s HF save is damaged: {err.problem}", fix) from err
    missing, extra = sorted(set(source_tensors) - set(saved)), sorted(set(saved) - set(source_tensors))
    if missing or extra:
        raise PipelineError(f"{directory} does not have the source's keys: missing {missing[:4]}, extra {extra[:4]}.",
                            "export a run trained from this source checkpoint (run.json source_dir).")
    for key, info in saved.items():
        if info.shape != source_tensors[key].shape:
            raise PipelineError(f"{directory}: {key} has shape {info.shape}, the source {source_tensors[key].shape}.",
                                "export a run trained from this source checkpoint.")
    codes = {info.dtype for info in saved.values()}
    names = {dtypes.SAFETENSORS_NAMES.get(code) for code in codes}
    if len(names) != 1 or None in names:
        raise PipelineError(f"{directory} holds tensors of dtypes {sorted(codes)}; the trainer saves one export dtype.", fix)
    return SavedModel(step, directory, shards, saved, names.pop())


def check_dtype(saved: SavedModel, dtype: str) -> None:
    if dtypes.DTYPES[dtype].bytes > dtypes.DTYPES[saved.dtype].bytes:
        raise PipelineError(f"step {saved.step} was saved in {saved.dtype} (the run's export_dtype); a {dtype} export "
                            "would only pad those values.",
                            f"train with DTYPE={dtype} (--export-dtype {dtype}): the run resumes at step {saved.step} "
                            "and saves its model again in that dtype; then export.")


def _link(source: Path, target: Path) -> None:
    """A hard link: the export costs no disk and no copy. Across filesystems, a copy."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def _checked(reader, key: str, where: Path, mapped: bool = False):
    """The tensor, read (or, `mapped`, a view of the file's pages: only looked at), refused unless finite."""
    import warnings

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # torch.from_numpy of a read-only map: only read here
            tensor = reader.view(key) if mapped else reader.get(key)
    except (OSError, ValueError) as err:
        raise PipelineError(f"{where} cannot be read ({err}).",
                            f"delete {where.parent} and rerun the training command; it saves the model again.") from err
    if tensor.is_floating_point() and not stream.finite(tensor):
        raise PipelineError(f"{where}: tensor {key} holds NaN or Inf; the run diverged.",
                            "export an earlier step (--step) or retrain with a lower learning rate.")
    return tensor


def write_shards(saved: SavedModel, tmp: Path, dtype: str) -> dict[str, str]:
    """Each shard linked (the saved dtype) or cast tensor by tensor (a narrower one), every tensor
    read and checked finite; returns file → sha256: a linked shard's as the trainer hashed it when it
    saved it (step-N/hf/.sha256.json), a cast one's as it is written."""
    import torch
    from tqdm import tqdm

    total = sum(shard.stat().st_size for shard in saved.shards)
    hashes = {}
    recorded = _recorded_hashes(saved.directory) if dtype == saved.dtype else {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=total < stream.PROGRESS_MIN_BYTES) as bar:
        for shard, name in saved.names().items():
            with stream.SafetensorsReader(shard) as reader:
                keys = reader.keys()
                if dtype == saved.dtype:
                    _link(shard, tmp / name)
                    for key in keys:
                        _checked(reader, key, shard, mapped=True)
                    if shard.name in recorded and recorded[shard.name][1:] == _stat(shard):
                        hashes[name] = recorded[shard.name][0]
                else:
                    entries = [stream.Entry(k, dtype, saved.tensors[k].shape) for k in keys]
                    with stream.SafetensorsWriter(tmp / name, entries, metadata={"format": "pt"}, sync=False) as writer:
                        for key in keys:
                            writer.write(_checked(reader, key, shard).to(getattr(torch, dtype)))
                        hashes[name] = writer.close()
            bar.update(shard.stat().st_size)
    if len(saved.shards) > 1:
        weight_map = {key: info.shard for key, info in saved.tensors.items()}
        size = sum(stream.Entry(key, dtype, info.shape).nbytes for key, info in saved.tensors.items())
        index = {"metadata": {"total_size": size}, "weight_map": dict(sorted(weight_map.items()))}
        (tmp / hf_dir.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return hashes


def _recorded_hashes(directory: Path) -> dict[str, tuple[str, int, int]]:
    """Shard → (sha256, bytes, mtime_ns) as the trainer recorded them; none for a save without them, or
    unreadable ones (then the manifest hashes the files)."""
    try:
        recorded = json.loads((directory / rundir.HF_HASHES).read_text())
        return {name: (str(v["sha256"]), int(v["bytes"]), int(v["mtime_ns"])) for name, v in recorded.items()}
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _stat(path: Path) -> tuple[int, int]:
    status = path.stat()
    return status.st_size, status.st_mtime_ns


def write_config(source: Path, tmp: Path, dtype: str, arch: Qwen3Arch) -> None:
    """config.json in transformers' own current form (rope_parameters, dtype, MoE fields)."""
    import transformers

    config = transformers.AutoConfig.from_pretrained(str(source), trust_remote_code=False)
    config.dtype = dtype
    config.save_pretrained(str(tmp))
    written = load_arch(tmp)
    if written.to_dict() != arch.to_dict():
        raise PipelineError(f"transformers rewrote {source}/config.json into a different architecture.",
                            "report this; the source config.json may use fields transformers ignores.")


def export(config: ExportConfig) -> Path:
    started = time.perf_counter()
    spec = config.run.spec()
    source = Path(spec.source_dir)
    if config.target.exists() and not config.force:
        raise PipelineError(f"{config.target} already exists.", "pass FORCE=1 (--force) to replace it.")
    source_report = hf_dir.validate(source)
    arch = spec.arch
    if arch != source_report.arch:
        raise PipelineError(f"{source}/config.json no longer matches the architecture the run trained "
                            f"({config.run.run_json}).", "re-download the source checkpoint the run was trained from.")
    saved = saved_model(config.run, config.step, source_report.tensors)
    check_dtype(saved, config.dtype)
    with atomic_directory(config.target, replace=config.force) as tmp:
        hashes = write_shards(saved, tmp, config.dtype)
        write_config(source, tmp, config.dtype, arch)
        for name in hf_dir.CARRIED_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        hf_dir.validate(tmp)
        model_card.write(tmp, config.run, saved.step, config.dtype)
        # Names, never host paths: the directory is shared as a model repository.
        manifest.write(tmp, {"step": saved.step, "dtype": config.dtype, "model": spec.model, "run": config.run.path.name,
                             "path": spec.path, "weights": f"step-{saved.step}/{rundir.HF_WEIGHTS}",
                             "saved_dtype": saved.dtype}, known=hashes)
    size = sum(p.stat().st_size for p in config.target.glob("*.safetensors"))
    how = "linked" if config.dtype == saved.dtype else f"cast from {saved.dtype}"
    print(f"exported step {saved.step} of {config.run.path} → {config.target} ({len(saved.tensors)} tensors, {config.dtype}, "
          f"{how}, {size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)")
    return config.target


def export_adapter(config: ExportConfig) -> Path:
    """A LoRA run's adapters as PEFT saves them (adapter_config.json, adapter_model.safetensors), for
    `PeftModel.from_pretrained(<the source model>, <this directory>)`."""
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.titan import lora

    started = time.perf_counter()
    spec = config.run.spec()
    settings = spec.settings
    if settings.lora_rank <= 0:
        raise PipelineError(f"run {config.run.path.name} is not a LoRA run (lora_rank = 0): it has no adapters.",
                            "export its full weights (without ADAPTER=1).")
    target = Path(config.output) if config.output else config.run.adapter_export
    if target.exists() and not config.force:
        raise PipelineError(f"{target} already exists.", "pass FORCE=1 (--force) to replace it.")
    step, hf = config.run.hf_weights(config.step)
    adapters_file = hf.parent / rundir.ADAPTERS
    if not adapters_file.is_file():
        raise PipelineError(f"{adapters_file} does not exist: step {step} was saved without its adapters.",
                            "train the run again with FRESH=1 (a run's last step saves them).")
    model_spec = registry.get(spec.path).build(spec)
    adapter = model_spec.state_dict_adapter(model_spec.model, None)
    # The run's own keys and shapes: the HF save's headers mapped back by the run's adapter, on meta tensors.
    saved = hf_dir.read_tensors(hf)
    meta = adapter.from_hf({key: torch.empty(info.shape, device="meta") for key, info in saved.items()})
    tensors = lora.peft_tensors(load_file(str(adapters_file)), meta,
                                lambda key: next(iter(adapter.to_hf({key: meta[key]}))), spec.arch.num_key_value_heads)
    modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[1] for key in tensors})
    peft_config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": settings.lora_rank,
                   "lora_alpha": settings.lora_alpha, "target_modules": modules, "lora_dropout": 0.0,
                   "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False,
                   "base_model_name_or_path": spec.model}
    with atomic_directory(target, replace=config.force) as tmp:
        save_file({k: v.to(getattr(torch, config.dtype)) for k, v in tensors.items()},
                  str(tmp / "adapter_model.safetensors"), metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(peft_config, indent=2) + "\n")
        manifest.write(tmp, {"step": step, "dtype": config.dtype, "model": spec.model, "run": config.run.path.name,
                             "path": spec.path, "adapters": adapters_file.name})
    print(f"exported the LoRA adapters of step {step} of {config.run.path} → {target} ({len(tensors) // 2} adapted "
          f"modules: {', '.join(modules)}; rank {settings.lora_rank}, alpha {settings.lora_alpha}, "
          f"{time.perf_counter() - started:.1f} s)")
    return target
