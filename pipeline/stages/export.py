"""Stage `export`: a run's last complete checkpoint as a Hugging Face checkpoint, <run dir>/export/.

Reads only the safetensors weights copy beside each DCP step (DCP's .metadata is a pickle and
is never read), converts keys with the run's own state-dict adapter, writes shards, config.json
(transformers' current form), the tokenizer files and manifest.json (last) into a temporary
sibling, renamed into place only when complete. See docs/design.md for the tied lm_head rule.
"""

from __future__ import annotations

import argparse
import errno
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.checkpoint import hf_dir, manifest
from pipeline.checkpoint.arch import Qwen3Arch, load_arch
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory
from pipeline.models import registry
from pipeline.run import store
from pipeline.run.rundir import RunDir
from pipeline.run.settings import DTYPES
from pipeline.run.spec import RunSpec

# Carried over verbatim when the source has them: tokenizer and generation defaults.
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "tokenizer.model")
PROGRESS_MIN_BYTES = 1 << 30


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


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", required=True, choices=registry.names(), help="training path of the run")
    parser.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="export dtype (float32 for exact checks)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the last)")
    parser.add_argument("--force", action="store_true", help="replace an existing export (atomically)")


def run(args: argparse.Namespace) -> Path:
    from huggingface_hub import split_torch_state_dict_into_shards

    try:  # the public splitter parses the size the same way the export will
        split_torch_state_dict_into_shards({}, max_shard_size=args.max_shard_size)
    except ValueError as err:
        raise PipelineError(f"MAX_SHARD_SIZE={args.max_shard_size!r} is not a size ({err}).",
                            "give a number with a unit, e.g. 5GB or 500MB.") from err
    config = ExportConfig(run=store.home(args.model).run(args.path), dtype=args.dtype,
                          max_shard_size=args.max_shard_size, step=args.step, force=args.force)
    return export(config)


def to_hf(titan_state: dict, spec: RunSpec, source_keys: set[str]) -> dict:
    """The run's model keys → the source checkpoint's Hugging Face keys, via the state-dict
    adapter the run's model spec names (torchtitan's Qwen3StateDictAdapter on native/nki)."""
    arch = spec.arch
    model_spec = registry.get(spec.path).build(spec)
    adapter = model_spec.state_dict_adapter(model_spec.model, None)
    hf_state = adapter.to_hf(titan_state)
    if arch.tie_word_embeddings:
        hf_state.pop("lm_head.weight", None)
        if "lm_head.weight" in source_keys:
            # The adapter drops a tied lm_head; this source stores it, so the export does too.
            hf_state["lm_head.weight"] = hf_state["model.embed_tokens.weight"].clone()
    missing, extra = sorted(source_keys - set(hf_state)), sorted(set(hf_state) - source_keys)
    if missing or extra:
        raise PipelineError(f"the converted weights do not have the source's keys: missing {missing[:4]}, extra {extra[:4]}.",
                            "export a run trained from this source checkpoint (run.json source_dir).")
    return hf_state


def read_titan_weights(path: Path) -> dict:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    hf_dir.read_header(path)  # truncation → a clear error before anything is read
    state = {}
    try:
        with safe_open(str(path), framework="pt") as handle:
            for key in handle.keys():
                tensor = handle.get_tensor(key)
                if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                    raise PipelineError(f"{path}: tensor {key} holds NaN or Inf; the run diverged.",
                                        "export an earlier step (--step) or retrain with a lower learning rate.")
                state[key] = tensor
    except SafetensorError as err:
        raise PipelineError(f"{path} cannot be read ({err}).", "rerun the training stage to rewrite the checkpoint.") from err
    return state


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


def write_shards(state: dict, tmp: Path, max_shard_size: str) -> dict[str, str]:
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors import SafetensorError
    from safetensors.torch import save_file
    from tqdm import tqdm

    split = split_torch_state_dict_into_shards(state, max_shard_size=max_shard_size,
                                               filename_pattern="model{suffix}.safetensors")
    total = sum(t.numel() * t.element_size() for t in state.values())
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=total < PROGRESS_MIN_BYTES) as bar:
        for filename, keys in split.filename_to_tensors.items():
            try:
                save_file({k: state[k].contiguous() for k in keys}, str(tmp / filename), metadata={"format": "pt"})
            except SafetensorError as err:
                # safetensors reports a full disk as its own error type; name it the way the CLI does.
                if "os error 28" in str(err):
                    raise OSError(errno.ENOSPC, "No space left on device", str(tmp.parent)) from err
                raise
            bar.update(sum(state[k].numel() * state[k].element_size() for k in keys))
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(split.tensor_to_filename.items()))}
    (tmp / hf_dir.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return split.tensor_to_filename


def export(config: ExportConfig) -> Path:
    import torch

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
    titan_state = read_titan_weights(weights)
    hf_state = to_hf(titan_state, spec, set(source_report.tensors))
    del titan_state
    for key, tensor in hf_state.items():
        expected = source_report.tensors[key].shape
        if tuple(tensor.shape) != expected:
            raise PipelineError(f"{weights}: {key} has shape {tuple(tensor.shape)}, the source {expected}.",
                                "export a run trained from this source checkpoint.")
        hf_state[key] = tensor.to(getattr(torch, config.dtype))
    with atomic_directory(config.target, replace=config.force) as tmp:
        write_shards(hf_state, tmp, config.max_shard_size)
        write_config(source, tmp, config.dtype, arch)
        for name in CARRIED_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        hf_dir.validate(tmp)
        manifest.write(tmp, {"step": step, "dtype": config.dtype, "source": str(source),
                             "run_dir": str(config.run.path), "weights": str(weights)})
    size = sum(p.stat().st_size for p in config.target.glob("*.safetensors"))
    print(f"exported step {step} of {config.run.path} → {config.target} ({len(hf_state)} tensors, {config.dtype}, "
          f"{size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)")
    return config.target
