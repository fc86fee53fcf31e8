"""Stage `export`: a run's last checkpoint as a Hugging Face checkpoint, checkpoints/<name>/<run>/export/.

Where the weights come from: torchtitan's DCP checkpoints keep their index in `.metadata`,
a pickle, and this project never unpickles a checkpoint. Loading DCP through torch's own
reader would unpickle it, and converting DCP offline (dcp_to_torch_save) writes a pickle.
So the trainer's checkpointer (pipeline.titan_trainer.WeightsCheckpointManager) writes,
beside each DCP step, `model_weights.safetensors`: the full model state dict with
torchtitan's keys, gathered from the FSDP shards. Export reads only that file.

Keys and layouts are converted by torchtitan's own Qwen3StateDictAdapter.to_hf (fused
q/k/v split, grouped experts split into the Hub's per-expert keys). What it gets wrong for
export is fixed here: with tied embeddings it always drops lm_head.weight, while some tied
checkpoints on the Hub store it — the export's key set must equal the source's, so it is
written back (equal to the embedding) exactly when the source had it.

Everything is written into a temporary sibling and renamed to export/ only when complete,
with manifest.json (sha256 of every file) written last; an interrupted export leaves only a
`.export.tmp-*` folder, which nothing mistakes for an export.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline import hf_checkpoint, paths
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory, atomic_write_text
from pipeline.qwen3_arch import Qwen3Arch, load_arch
from pipeline.run_spec import RunSpec

EXPORT_DIR = "export"
MANIFEST = "manifest.json"
WEIGHTS_FILE = "model_weights.safetensors"  # same name as pipeline.titan_trainer.WEIGHTS_FILE
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
# Carried over verbatim when the source has them: tokenizer and generation defaults.
CARRIED_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt",
                 "special_tokens_map.json", "added_tokens.json", "chat_template.jinja", "tokenizer.model")
PROGRESS_MIN_BYTES = 1 << 30


@dataclass(frozen=True)
class ExportConfig:
    run_dir: Path
    dtype: str = "bf16"
    max_shard_size: str = "5GB"
    step: int | None = None
    force: bool = False
    output: Path | None = None  # default <run_dir>/export

    @property
    def target(self) -> Path:
        return Path(self.output) if self.output else self.run_dir / EXPORT_DIR


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--run", required=True, help="training path of the run: hf, native or nki")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="export dtype (fp32 for exact checks)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest shard, e.g. 5GB, 500MB")
    parser.add_argument("--step", type=int, help="checkpoint step to export (default: the last)")
    parser.add_argument("--force", action="store_true", help="replace an existing export (atomically)")


def run(args: argparse.Namespace) -> Path:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        parse_size_to_int(args.max_shard_size)
    except ValueError as err:
        raise PipelineError(f"MAX_SHARD_SIZE={args.max_shard_size!r} is not a size ({err}).",
                            "give a number with a unit, e.g. 5GB or 500MB.") from err
    config = ExportConfig(run_dir=paths.run_dir(args.model, args.run), dtype=args.dtype,
                          max_shard_size=args.max_shard_size, step=args.step, force=args.force)
    return export(config)


def checkpoint_steps(run_dir: Path) -> dict[int, Path]:
    folder = Path(run_dir) / "checkpoint"
    found = {}
    for item in folder.glob("step-*") if folder.is_dir() else ():
        match = re.fullmatch(r"step-(\d+)", item.name)
        if match and item.is_dir():
            found[int(match.group(1))] = item
    return found


def weights_file(run_dir: Path, step: int | None = None) -> tuple[int, Path]:
    """The safetensors weights of the last (or the given) checkpoint of a run."""
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise PipelineError(f"{run_dir} has no checkpoint yet.", "train first (`make train-… STEPS=N`; STEPS=0 saves the loaded weights).")
    if step is None:
        # The trainer renames the weights file into place last, so only a step that has it is
        # complete; a save cut short by a kill is skipped, as torchtitan's resume skips it.
        complete = [s for s, directory in steps.items() if (directory / WEIGHTS_FILE).exists()]
        step = max(complete or steps)
    elif step not in steps:
        raise PipelineError(f"{run_dir} has no checkpoint of step {step} (it has {sorted(steps)}).", "pick one of those steps.")
    path = steps[step] / WEIGHTS_FILE
    if not path.exists():
        raise PipelineError(f"{steps[step]} has no {WEIGHTS_FILE} (interrupted save, or made by another trainer).",
                            "resume or rerun the training stage so the checkpoint is written completely.")
    return step, path


def load_run(run_dir: Path) -> tuple[RunSpec, Path]:
    run_json = Path(run_dir) / "run.json"
    if not run_json.exists():
        raise PipelineError(f"{run_json} does not exist: no run there.", "train first, e.g. `make train-native MODEL=tiny`.")
    spec = RunSpec.load(run_json)
    return spec, Path(spec.hf_dir)


def to_hf(titan_state: dict, spec: RunSpec, source_keys: set[str]) -> dict:
    """The run's model keys → the source checkpoint's Hugging Face keys, via the state-dict
    adapter the run's model spec names (torchtitan's Qwen3StateDictAdapter on native/nki)."""
    from pipeline import model_builders

    arch = Qwen3Arch(**spec.arch)
    model_spec = model_builders.build(spec)
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
                            "export a run trained from this source checkpoint (run.json hf_dir).")
    return hf_state


def read_titan_weights(path: Path) -> dict:
    import torch
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    hf_checkpoint.read_header(path)  # truncation → a clear error before anything is read
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
    (tmp / hf_checkpoint.INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return split.tensor_to_filename


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(tmp: Path, info: dict) -> None:
    files = {p.name: {"sha256": sha256(p), "bytes": p.stat().st_size} for p in sorted(tmp.iterdir()) if p.is_file()}
    atomic_write_text(tmp / MANIFEST, json.dumps({**info, "files": files}, indent=2) + "\n")


def check_manifest(directory: Path) -> dict:
    """Re-hash every file listed in manifest.json; raise on any difference."""
    path = Path(directory) / MANIFEST
    if not path.exists():
        raise PipelineError(f"{directory} has no {MANIFEST}: not a complete export.", "re-run `make export … FORCE=1`.")
    manifest = json.loads(path.read_text())
    for name, entry in manifest["files"].items():
        file = Path(directory) / name
        if not file.exists():
            raise PipelineError(f"{file} is listed in {MANIFEST} but missing.", "re-run `make export … FORCE=1`.")
        if file.stat().st_size != entry["bytes"] or sha256(file) != entry["sha256"]:
            raise PipelineError(f"{file} differs from its sha256 in {MANIFEST}.", "re-run `make export … FORCE=1`.")
    return manifest


def export(config: ExportConfig) -> Path:
    import torch

    started = time.perf_counter()
    spec, source = load_run(config.run_dir)
    if config.target.exists() and not config.force:
        raise PipelineError(f"{config.target} already exists.", "pass FORCE=1 (--force) to replace it.")
    step, weights = weights_file(config.run_dir, config.step)
    source_report = hf_checkpoint.validate(source)
    arch = Qwen3Arch(**spec.arch)
    if arch.to_dict() != source_report.arch.to_dict():
        raise PipelineError(f"{source}/config.json no longer matches the architecture the run trained ({config.run_dir}/run.json).",
                            "re-download the source checkpoint the run was trained from.")
    dtype_name = DTYPES[config.dtype]
    titan_state = read_titan_weights(weights)
    hf_state = to_hf(titan_state, spec, set(source_report.tensors))
    del titan_state
    for key, tensor in hf_state.items():
        expected = source_report.tensors[key].shape
        if tuple(tensor.shape) != expected:
            raise PipelineError(f"{weights}: {key} has shape {tuple(tensor.shape)}, the source {expected}.",
                                "export a run trained from this source checkpoint.")
        hf_state[key] = tensor.to(getattr(torch, dtype_name))
    with atomic_directory(config.target, replace=config.force) as tmp:
        write_shards(hf_state, tmp, config.max_shard_size)
        write_config(source, tmp, dtype_name, arch)
        for name in CARRIED_FILES:
            if (source / name).exists():
                shutil.copy2(source / name, tmp / name)
        hf_checkpoint.validate(tmp)
        write_manifest(tmp, {"step": step, "dtype": dtype_name, "source": str(source),
                             "run_dir": str(config.run_dir), "weights": str(weights)})
    size = sum(p.stat().st_size for p in config.target.glob("*.safetensors"))
    print(f"exported step {step} of {config.run_dir} → {config.target} ({len(hf_state)} tensors, {dtype_name}, "
          f"{size / 2**20:.1f} MiB, {time.perf_counter() - started:.1f} s)")
    return config.target
