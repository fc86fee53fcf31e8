"""Reading and validating a Hugging Face–format checkpoint directory, without loading it.

Shared by download (import of a local directory), export and verify. Only safetensors are
ever read; a pickle-based weight file in the directory is refused, never opened.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from huggingface_hub import constants

from pipeline.errors import PipelineError
from pipeline.checkpoint.arch import Qwen3Arch, load_arch
from pipeline.fsutil import INDEX_FILE_BYTES, read_small_text, regular_file

# A Hugging Face checkpoint directory's file names, one home: huggingface_hub's where it names them.
CONFIG = constants.CONFIG_NAME  # config.json
INDEX = constants.SAFETENSORS_INDEX_FILE  # model.safetensors.index.json
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
TOKENIZER_REQUIRED = ("tokenizer.json", "tokenizer_config.json")
# The tokenizer files a Qwen3 checkpoint may have (the embedded ones have the first four).
TOKENIZER_FILES = TOKENIZER_REQUIRED + ("vocab.json", "merges.txt", "special_tokens_map.json", "added_tokens.json",
                                        "chat_template.jinja", "chat_template.json", "tokenizer.model")
# Carried over verbatim into an export when the source has them: generation defaults and the tokenizer.
CARRIED_FILES = ("generation_config.json",) + TOKENIZER_FILES
# What a download takes of a Hub snapshot, or of a local directory: the files above and the weights.
HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "merges.txt", "vocab.json", "*.jinja"]
LOCAL_SUFFIXES = (".json", ".safetensors", ".txt", ".model", ".jinja")


@dataclass(frozen=True)
class TensorInfo:
    shard: str
    dtype: str
    shape: tuple[int, ...]


@dataclass
class CheckpointReport:
    arch: Qwen3Arch
    tensors: dict[str, TensorInfo]
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    mismatched: list[str] = field(default_factory=list)


def read_header(path: Path, fix: str = "re-download the checkpoint (FORCE=1), or re-export it (FORCE=1).") -> dict[str, TensorInfo]:
    """Tensor name → dtype/shape from a safetensors header (safetensors' own parser, which also
    refuses a truncated file or a corrupt header); no tensor data is read. The numpy framework
    keeps torch out of processes that only look (the train launcher, dry runs)."""
    from safetensors import SafetensorError, safe_open

    path = Path(path)
    regular_file(path, fix)  # safetensors would open a FIFO and wait for a writer
    try:
        with safe_open(str(path), framework="numpy") as handle:
            infos = {}
            for name in handle.keys():
                info = handle.get_slice(name)
                infos[name] = TensorInfo(path.name, info.get_dtype(), tuple(info.get_shape()))
            return infos
    except SafetensorError as err:
        raise PipelineError(f"{path} is truncated or corrupt ({err}).", fix) from err


def link_root(directory: Path) -> Path:
    """How far a symlink in `directory` may lead: the directory itself, or, for a snapshot in the
    Hugging Face cache (whose files are links to ../../blobs/), its repository's cache folder."""
    from huggingface_hub import constants

    directory = Path(directory).resolve()
    cache = Path(constants.HF_HUB_CACHE).resolve()
    if directory.parent.name == "snapshots" and directory.is_relative_to(cache):
        return directory.parent.parent
    return directory


def check_links(directory: Path) -> None:
    """Refuse a symlink that leads out of the checkpoint directory (a chat_template.jinja → /etc/passwd
    would be copied into source/ and every export): its files are read and copied as the checkpoint's."""
    root = link_root(directory)
    for item in Path(directory).iterdir():
        if not item.is_symlink():
            continue
        try:
            target = item.resolve()
        except (OSError, RuntimeError):  # a loop
            target = Path(os.readlink(item))
        if not target.is_relative_to(root):
            raise PipelineError(f"{item} is a symlink to {target}, outside the checkpoint directory {root}; "
                                "it is not read.", "replace the link by the file it stands for (cp -L), or remove it.")


def shard_files(directory: Path) -> list[Path]:
    """The safetensors shards a checkpoint consists of, cross-checked against its index."""
    directory = Path(directory)
    check_links(directory)
    pickles = sorted(p.name for p in directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise PipelineError(
            f"{directory} contains pickle-based weight files {pickles}; they are never loaded (unsafe).",
            "remove them and provide safetensors only.",
        )
    on_disk = sorted(p.name for p in directory.glob("*.safetensors"))
    index_path = directory / INDEX
    if index_path.exists():
        try:
            weight_map = json.loads(read_small_text(index_path, INDEX_FILE_BYTES, "restore the checkpoint's index."))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise PipelineError(f"{index_path} is not a valid index ({err}).", "re-download or re-export it.") from err
        indexed = sorted(set(weight_map.values()))
        absent = [s for s in indexed if s not in on_disk]
        if absent:
            raise PipelineError(f"{index_path} names shards that are missing: {absent}.",
                                "re-download the checkpoint (`make download` resumes).")
        stray = [s for s in on_disk if s not in indexed]
        if stray:
            raise PipelineError(f"{directory} has shards not in {INDEX}: {stray}.",
                                "remove them or regenerate the index.")
        return [directory / s for s in indexed]
    if len(on_disk) == 1:
        return [directory / on_disk[0]]
    if not on_disk:
        raise PipelineError(f"{directory} holds no .safetensors weights.", "point MODEL at a checkpoint directory.")
    raise PipelineError(f"{directory} has {len(on_disk)} shards but no {INDEX}.", "restore the index file.")


def read_tensors(directory: Path) -> dict[str, TensorInfo]:
    directory = Path(directory)
    tensors: dict[str, TensorInfo] = {}
    index_path = directory / INDEX
    shards = shard_files(directory)  # checks the index first
    weight_map = json.loads(read_small_text(index_path, INDEX_FILE_BYTES))["weight_map"] if index_path.exists() else None
    for shard in shards:
        for name, info in read_header(shard).items():
            if name in tensors:
                raise PipelineError(f"{name} is stored twice ({tensors[name].shard}, {shard.name}).", "re-export it.")
            if weight_map is not None and weight_map.get(name) != shard.name:
                raise PipelineError(f"{INDEX} places {name} in {weight_map.get(name)}, but it is in {shard.name}.",
                                    "regenerate the index.")
            tensors[name] = info
    if weight_map is not None:
        lost = sorted(set(weight_map) - set(tensors))
        if lost:
            raise PipelineError(f"{INDEX} lists tensors no shard holds: {lost[:5]}…", "re-download or re-export it.")
    return tensors


def inspect(directory: Path, require_tokenizer: bool = True) -> CheckpointReport:
    """Validate a checkpoint directory against its own config.json; raise on any defect."""
    directory = Path(directory)
    if not directory.is_dir():
        raise PipelineError(f"{directory} is not a directory.", "give MODEL as a Hub id, a checkpoint directory or tiny/tiny-moe.")
    check_links(directory)
    arch = load_arch(directory)
    if require_tokenizer:
        absent = [f for f in TOKENIZER_REQUIRED if not (directory / f).exists()]
        if absent:
            raise PipelineError(f"{directory} lacks tokenizer files {absent}.", "copy the tokenizer from the source checkpoint.")
    tensors = read_tensors(directory)
    expected = arch.expected_shapes()
    report = CheckpointReport(arch=arch, tensors=tensors)
    report.missing = sorted(set(expected) - set(tensors))
    optional = {"lm_head.weight"} if arch.tie_word_embeddings else set()
    report.unexpected = sorted(set(tensors) - set(expected) - optional)
    report.mismatched = sorted(
        f"{k}: {tensors[k].shape} on disk, {expected[k]} by config.json"
        for k in set(tensors) & set(expected)
        if tensors[k].shape != expected[k]
    )
    return report


def validate(directory: Path, require_tokenizer: bool = True) -> CheckpointReport:
    report = inspect(directory, require_tokenizer)
    problems = []
    if report.missing:
        problems.append(f"missing tensors {report.missing[:4]}{'…' if len(report.missing) > 4 else ''}")
    if report.unexpected:
        problems.append(f"unexpected tensors {report.unexpected[:4]}")
    if report.mismatched:
        problems.append("config.json disagrees with the tensors: " + "; ".join(report.mismatched[:3]))
    if problems:
        raise PipelineError(f"{directory}: " + ", ".join(problems) + ".",
                            "use the checkpoint's own config.json and all of its shards.")
    return report
