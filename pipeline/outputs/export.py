"""A run's last complete checkpoint as a Hugging Face checkpoint, <run dir>/export/.

The trainer already wrote the model of a run's last step in HF safetensors, through torchtitan's own
HF writer (step-N/hf: the run's state-dict adapter, DCP's HuggingFaceStorageWriter, the source's
shard layout, the export dtype). Export checks those files against the sha256 the ranks recorded as
they saved them (step-N/hf/.sha256.json: an edit since, even through a linked export, is named) and
against the source checkpoint (keys, shapes, finite values: nothing is trusted because of where it
lies), links them into a temporary sibling (a copy where the filesystem cannot link; a copy with
save_pretrained's {"format": "pt"} header metadata where the save predates the trainer writing it),
adds config.json (the source's, only the dtype changed), the generation config and tokenizer files as
the source has them, the model card and manifest.json (last), and renames it into place only when
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
from pipeline.flags import flag
from pipeline.checkpoint import hf_dir, manifest, stream
from pipeline.checkpoint.arch import Qwen3Arch, load_arch
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory, give_ordinary_modes, regular_file
from pipeline.models import registry
from pipeline.outputs import model_card
from pipeline.run import rundir
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
class ExportRequest:
    """What `make export` asks for of a run (the run itself: RunRef). Its fields are the `export` stage's
    flags (pipeline.flags) and Make variables (pipeline.host.makevars)."""

    dtype: str = flag(ExportConfig.dtype, "export dtype: the run's export_dtype (linked) or narrower (cast)",
                      choices=dtypes.NAMES, make="DTYPE")
    step: int | None = flag(None, "checkpoint step to export (default: the last)")
    force: bool = flag(False, "replace an existing export (atomically)", make="FORCE")
    adapter: bool = flag(False, "a LoRA run's adapters alone, in PEFT's layout, to <run dir>/export-adapter",
                         make="ADAPTER", make_help="export: 1 writes a LoRA run's adapters alone (PEFT's save_pretrained, "
                         "tokenizer, card) to <run dir>/export-adapter; publish: 1 uploads those")

    def config(self, run: RunDir) -> ExportConfig:
        return ExportConfig(run=run, dtype=self.dtype, step=self.step, force=self.force)


@dataclass(frozen=True)
class SavedModel:
    """A run step's HF save, checked against its source: its shards (HF's names) and dtype."""

    step: int
    directory: Path
    shards: list[Path]
    tensors: dict[str, hf_dir.TensorInfo]
    dtype: str  # torch's name
    hashes: dict[str, str]  # shard name → sha256, checked against what the ranks recorded as they saved it

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
    return SavedModel(step, directory, shards, saved, names.pop(), run.hf_hashes(step))


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
    read and checked finite; returns file → sha256: a linked shard's as the ranks recorded it when they
    saved it (step-N/hf/.sha256.json, checked by saved_model), a cast one's as it is written."""
    import torch
    from tqdm import tqdm

    total = sum(shard.stat().st_size for shard in saved.shards)
    hashes = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=total < stream.PROGRESS_MIN_BYTES) as bar:
        for shard, name in saved.names().items():
            with stream.SafetensorsReader(shard) as reader:
                keys = reader.keys()
                if dtype == saved.dtype and stream.has_pt_format(shard):
                    _link(shard, tmp / name)
                    for key in keys:
                        _checked(reader, key, shard, mapped=True)
                    hashes[name] = saved.hashes[shard.name]
                elif dtype == saved.dtype:  # saved before the trainer marked its shards: a marked copy
                    for key in keys:
                        _checked(reader, key, shard, mapped=True)
                    stream.copy_with_metadata(shard, tmp / name, stream.PT_METADATA)
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


def _read_adapters(path: Path) -> dict:
    """lora_adapters.safetensors, refused in one line when it is no regular file or safetensors cannot parse
    it (a torn or edited file)."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    fix = "train the run again with FRESH=1 (a run's last step saves its adapters)."
    regular_file(path, fix)
    try:
        return load_file(str(path))
    except (SafetensorError, OSError) as err:
        raise PipelineError(f"{path} is not a readable safetensors file ({err}).", fix) from err


# The keys a config.json names its dtype by: transformers 4.x wrote torch_dtype, 5 writes dtype (and reads both).
DTYPE_KEYS = ("torch_dtype", "dtype")


def write_config(source: Path, tmp: Path, dtype: str, arch: Qwen3Arch) -> None:
    """config.json: the source's own, every key and value kept in its order (a transformers 4.x config's
    top-level rope_theta and rope_scaling, which transformers 5 would rewrite into rope_parameters and
    transformers 4.57 then no longer finds, reading rope_theta 10000), with only what training changed
    updated: the dtype, under the key the source spells it by (dtype where it names none)."""
    from pipeline.fsutil import read_small_text

    config = json.loads(read_small_text(source / hf_dir.CONFIG))
    for key in [k for k in DTYPE_KEYS if k in config] or ["dtype"]:
        config[key] = dtype
    (tmp / hf_dir.CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    written = load_arch(tmp)
    if written.to_dict() != arch.to_dict():
        raise PipelineError(f"{source}/config.json no longer describes the architecture the run trained.",
                            "re-download the source checkpoint the run was trained from.")


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
                shutil.copyfile(source / name, tmp / name)  # not copy2: a read-only source is no read-only export
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
    """A LoRA run's adapters written by PEFT itself (LoraConfig, PeftModel.save_pretrained: adapter_config.json,
    adapter_model.safetensors), with the tokenizer and a card beside them, for
    `AutoPeftModelForCausalLM.from_pretrained(<this directory>)`: base_model_name_or_path is the source's Hub id
    (and revision), or a local source's directory (the card says so)."""
    import torch
    import transformers
    from peft import LoraConfig, get_peft_model

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
    trained = _read_adapters(adapters_file)
    adapter = registry.get(spec.path).build(spec).adapter()
    # The run's own keys and shapes: the HF save's headers mapped back by the run's adapter, on meta tensors.
    saved = hf_dir.read_tensors(hf)
    meta = adapter.from_hf({key: torch.empty(info.shape, device="meta") for key, info in saved.items()})
    tensors = lora.peft_tensors(trained, meta, lambda key: next(iter(adapter.to_hf({key: meta[key]}))),
                                spec.arch.num_key_value_heads, lora.NAMES[registry.get(spec.path).lora.names])
    modules = sorted({key.split(".lora_")[0].rsplit(".", 1)[1] for key in tensors})
    base, revision, _on_hub = model_card.base_model(spec)
    peft_config = LoraConfig(task_type="CAUSAL_LM", r=settings.lora_rank, lora_alpha=settings.lora_alpha,
                             target_modules=modules, lora_dropout=0.0, bias="none", inference_mode=True,
                             base_model_name_or_path=base, revision=revision)
    # PEFT's own model of the adapters over the base architecture, on the meta device (no base weights are
    # read or held): the run's adapters are assigned into it and PEFT writes them. Assigned directly, under
    # PEFT's in-model names (<module>.lora_A.<adapter name>.weight): set_peft_model_state_dict would move
    # them onto their base layer's device, here meta (peft/utils/save_and_load.py, low_cpu_mem_usage).
    source = Path(spec.source_dir)
    hf_config = transformers.AutoConfig.from_pretrained(str(source))
    hf_config._name_or_path = base  # get_peft_model takes base_model_name_or_path from the model's name
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf_config)
    peft_model = get_peft_model(model, peft_config, adapter_name=lora.PEFT_ADAPTER, low_cpu_mem_usage=True)
    named = {key.replace(".lora_A.", f".lora_A.{lora.PEFT_ADAPTER}.").replace(".lora_B.", f".lora_B.{lora.PEFT_ADAPTER}."):
             value.to(getattr(torch, config.dtype)) for key, value in tensors.items()}
    loaded = peft_model.load_state_dict(named, strict=False, assign=True)
    empty = [name for name, param in peft_model.named_parameters() if ".lora_" in name and param.is_meta]
    if loaded.unexpected_keys or empty:
        raise PipelineError(f"PEFT's LoRA model of {source.name} does not take the run's adapters (unexpected "
                            f"{loaded.unexpected_keys[:3]}, not given {empty[:3]}).",
                            "report this: the run's adapted modules do not map onto the transformers model.")
    with atomic_directory(target, replace=config.force) as tmp:
        # No embedding layer is adapted (the vocabulary is the source's): "auto" would look the base model's
        # config.json up on the Hub to compare vocabularies (peft/utils/save_and_load.py).
        peft_model.save_pretrained(str(tmp), save_embedding_layers=False)
        for name in hf_dir.TOKENIZER_FILES:
            if (source / name).exists():
                shutil.copyfile(source / name, tmp / name)
        model_card.write(tmp, config.run, step, config.dtype, adapter=True,
                         verdict="the merged export's (`make verify-checkpoint`); these adapters are its difference "
                                 "from the base model")
        give_ordinary_modes(*(p for p in tmp.iterdir() if p.is_file()))  # PEFT's safetensors are 0600
        manifest.write(tmp, {"step": step, "dtype": config.dtype, "model": spec.model, "run": config.run.path.name,
                             "path": spec.path, "adapters": adapters_file.name})
    print(f"exported the LoRA adapters of step {step} of {config.run.path} → {target} ({len(tensors) // 2} adapted "
          f"modules: {', '.join(modules)}; rank {settings.lora_rank}, alpha {settings.lora_alpha}, "
          f"{time.perf_counter() - started:.1f} s)")
    return target
