"""A run's last complete checkpoint as a Hugging Face checkpoint, <run dir>/export/.

Reads only the safetensors weights copy beside the run's last DCP step (DCP's .metadata is a
pickle and is never read), converts keys with the run's own state-dict adapter, writes shards,
config.json (transformers' current form), the tokenizer files and manifest.json (last) into a
temporary sibling, renamed into place only when complete. See docs/design.md for the tied
lm_head rule.

Tensors stream through: the whole conversion is planned on meta tensors from the file's header
(keys, shapes, shards, all checked against the source before any data is read), then each
tensor is read, checked, converted, cast and written on its own, and each shard is hashed as it
is written. Peak memory is about the largest tensor, whatever the model's size.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint import hf_dir, manifest, stream
from pipeline.checkpoint.arch import Qwen3Arch, load_arch
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory
from pipeline.models import registry
from pipeline.run import model_card, rundir
from pipeline.run.rundir import RunDir
from pipeline.run.spec import RunSpec

EMBEDDING, LM_HEAD = "model.embed_tokens.weight", "lm_head.weight"


@dataclass(frozen=True)
class ExportConfig:
    run: RunDir
    dtype: str = "bfloat16"
    max_shard_size: str = "5GB"
    step: int | None = None
    force: bool = False
    output: Path | None = None  # default <run dir>/export

    @property
    def target(self) -> Path:
        return Path(self.output) if self.output else self.run.export


@dataclass
class Piece:
    """One tensor of the export: its HF key, the run's key it comes from, and its shape."""

    hf_key: str
    titan_key: str
    shape: tuple[int, ...]


def plan(weights: Path, spec: RunSpec, source_keys: dict, dtype: str) -> list[Piece]:
    """Every export tensor, from the weights file's header alone: the run's state-dict adapter
    (torchtitan's Qwen3StateDictAdapter on native/nki) applied to meta tensors, key by key."""
    import torch

    # truncation → a clear error before anything is read. A rerun of training rewrites a last step's
    # missing weights file (titan.trainer.PipelineTrainer.train), not a damaged one: it must go first.
    header = hf_dir.read_header(weights, f"delete {weights} and rerun the training command; it rewrites the weights "
                                         "of the run's last step.")
    model_spec = registry.get(spec.path).build(spec)
    adapter = model_spec.state_dict_adapter(model_spec.model, None)
    pieces: list[Piece] = []
    for titan_key, info in header.items():
        meta = torch.empty(info.shape, dtype=getattr(torch, dtype), device="meta")
        for hf_key, value in adapter.to_hf({titan_key: meta}).items():
            if hf_key == LM_HEAD and spec.arch.tie_word_embeddings:
                continue  # tied: the embedding is the lm_head (written below when the source has the key)
            pieces.append(Piece(hf_key, titan_key, tuple(value.shape)))
            if hf_key == EMBEDDING and spec.arch.tie_word_embeddings and LM_HEAD in source_keys:
                # The adapter drops a tied lm_head; this source stores it, so the export does too.
                pieces.append(Piece(LM_HEAD, titan_key, tuple(value.shape)))
    names = {p.hf_key for p in pieces}
    missing, extra = sorted(set(source_keys) - names), sorted(names - set(source_keys))
    if missing or extra or len(names) != len(pieces):
        raise PipelineError(f"the converted weights do not have the source's keys: missing {missing[:4]}, extra {extra[:4]}.",
                            "export a run trained from this source checkpoint (run.json source_dir).")
    for piece in pieces:
        if piece.shape != source_keys[piece.hf_key].shape:
            raise PipelineError(f"{weights}: {piece.hf_key} has shape {piece.shape}, the source "
                                f"{source_keys[piece.hf_key].shape}.", "export a run trained from this source checkpoint.")
    return pieces


class Converter:
    """Reads one tensor of the run's weights at a time and turns it into its HF pieces (cast to
    the export dtype); the last tensor's pieces are kept until the next is asked for."""

    def __init__(self, weights: Path, spec: RunSpec, dtype: str, tied_copy: bool):
        import torch

        from pipeline.checkpoint.stream import SafetensorsReader

        model_spec = registry.get(spec.path).build(spec)
        self.adapter = model_spec.state_dict_adapter(model_spec.model, None)
        self.weights, self.dtype, self.torch, self.tied_copy = weights, getattr(torch, dtype), torch, tied_copy
        self.reader = SafetensorsReader(weights)  # plan() validated the file with safetensors' parser
        self.current: tuple[str, dict] | None = None

    def get(self, piece: Piece):
        if self.current is None or self.current[0] != piece.titan_key:
            self.current = None  # frees the previous tensor before the next is read
            try:
                tensor = self.reader.get(piece.titan_key)
            except (OSError, ValueError) as err:
                raise PipelineError(f"{self.weights} cannot be read ({err}).",
                                    f"delete {self.weights} and rerun the training command; it rewrites the weights "
                                    "of the run's last step.") from err
            if tensor.is_floating_point() and not stream.finite(tensor):
                raise PipelineError(f"{self.weights}: tensor {piece.titan_key} holds NaN or Inf; the run diverged.",
                                    "export an earlier step (--step) or retrain with a lower learning rate.")
            converted = self.adapter.to_hf({piece.titan_key: tensor})
            del tensor
            converted = {k: v.to(self.dtype) for k, v in converted.items()}
            if self.tied_copy and EMBEDDING in converted:
                converted[LM_HEAD] = converted[EMBEDDING]
            self.current = (piece.titan_key, converted)
        return self.current[1][piece.hf_key]


def write_shards(pieces: list[Piece], convert: Converter, tmp: Path, max_shard_size: str, dtype: str) -> dict[str, str]:
    """Shards as huggingface_hub splits them, each written tensor by tensor; returns file → sha256."""
    import torch
    from huggingface_hub import split_torch_state_dict_into_shards
    from tqdm import tqdm

    from pipeline.checkpoint.stream import Entry, SafetensorsWriter

    by_key = {p.hf_key: p for p in pieces}
    order = {p.hf_key: i for i, p in enumerate(pieces)}
    meta = {p.hf_key: torch.empty(p.shape, dtype=getattr(torch, dtype), device="meta") for p in pieces}
    split = split_torch_state_dict_into_shards(meta, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    total = sum(t.numel() * t.element_size() for t in meta.values())
    hashes = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=total < stream.PROGRESS_MIN_BYTES) as bar:
        for filename, keys in split.filename_to_tensors.items():
            # Read in the weights file's order, so each of its tensors is converted once.
            keys = sorted(keys, key=order.__getitem__)
            entries = [Entry(k, dtype, by_key[k].shape) for k in keys]
            with SafetensorsWriter(tmp / filename, entries, metadata={"format": "pt"}, sync=False) as writer:
                for key in keys:
                    writer.write(convert.get(by_key[key]))
                    bar.update(meta[key].numel() * meta[key].element_size())
                hashes[filename] = writer.close()
    if split.is_sharded:  # one shard is save_pretrained's single file, model.safetensors, with no index
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
        (tmp / hf_dir.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return hashes


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
    step, weights = config.run.weights_file(config.step)
    source_report = hf_dir.validate(source)
    arch = spec.arch
    if arch != source_report.arch:
        raise PipelineError(f"{source}/config.json no longer matches the architecture the run trained "
                            f"({config.run.run_json}).", "re-download the source checkpoint the run was trained from.")
    pieces = plan(weights, spec, source_report.tensors, config.dtype)
    with atomic_directory(config.target, replace=config.force) as tmp:
        convert = Converter(weights, spec, config.dtype, tied_copy=any(p.hf_key == LM_HEAD for p in pieces) and arch.tie_word_embeddings)
        hashes = write_shards(pieces, convert, tmp, config.max_shard_size, config.dtype)
        write_config(source, tmp, config.dtype, arch)
        for name in hf_dir.CARRIED_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        hf_dir.validate(tmp)
        model_card.write(tmp, config.run, step, config.dtype)
        # Names, never host paths: the directory is shared as a model repository.
        manifest.write(tmp, {"step": step, "dtype": config.dtype, "model": spec.model, "run": config.run.path.name,
                             "path": spec.path, "weights": weights.name}, known=hashes)
    size = sum(p.stat().st_size for p in config.target.glob("*.safetensors"))
    print(f"exported step {step} of {config.run.path} → {config.target} ({len(pieces)} tensors, {config.dtype}, "
          f"{size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)")
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
    step, weights = config.run.weights_file(config.step)
    adapters_file = weights.with_name(rundir.ADAPTERS)
    if not adapters_file.is_file():
        raise PipelineError(f"{adapters_file} does not exist: step {step} was saved without its adapters.",
                            "train the run again with FRESH=1 (a run's last step saves them).")
    header = hf_dir.read_header(weights, f"delete {weights} and rerun the training command.")
    meta = {key: torch.empty(info.shape, device="meta") for key, info in header.items()}
    model_spec = registry.get(spec.path).build(spec)
    adapter = model_spec.state_dict_adapter(model_spec.model, None)
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
