"""Stage `download`: put an HF checkpoint at checkpoints/<name>/hf/, validated.

MODEL is one of: an embedded default (`tiny`, `tiny-moe`: made here, offline), a local
directory (validated, then imported), or a Hub id (snapshot_download of the safetensors,
JSON and tokenizer files at a pinned revision; resumable; HF_TOKEN from the environment).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tomllib
from pathlib import Path

from pipeline import embedded, hf_checkpoint, paths
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory
from pipeline.settings import CONFIG_DIR

HUB_PATTERNS = ["*.safetensors", "*.json", "tokenizer*", "merges.txt", "vocab.json"]


def known_models() -> dict:
    return tomllib.loads((CONFIG_DIR / "models.toml").read_text())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="Hub id, local HF directory, or tiny / tiny-moe")
    parser.add_argument("--revision", help="Hub revision (default: the pin in configs/models.toml)")
    parser.add_argument("--force", action="store_true", help="replace an existing checkpoints/<name>/hf")


def run(args: argparse.Namespace) -> Path:
    target = paths.hf_dir(args.model)
    if target.exists() and not args.force:
        hf_checkpoint.validate(target)
        print(f"{target} already exists and is valid; nothing to do (--force to replace).")
        return target
    if paths.is_embedded(args.model):
        # Fail on an unwritable checkpoints root now, not after minutes of making the weights.
        target.parent.mkdir(parents=True, exist_ok=True)
        provenance = embedded.bootstrap(args.model, target) if not target.exists() else _rebuild(args.model, target)
        print(f"made embedded {args.model}: pretraining loss {provenance['first_loss']:.3f} → {provenance['final_loss']:.3f}")
    elif Path(args.model).is_dir():
        _import_local(Path(args.model), target, replace=args.force)
    elif args.model.startswith(("/", ".", "~")) or args.model.count("/") > 1:
        # Hub ids are exactly org/name; anything else with slashes was meant as a directory.
        raise PipelineError(f"MODEL={args.model!r} is not an existing directory (and not a Hub id org/name).",
                            "check the path.")
    elif "/" in args.model and not Path(args.model).exists():
        _download_hub(args.model, args.revision, target, replace=args.force)
    else:
        raise PipelineError(f"MODEL={args.model!r} is not a Hub id (org/name), an existing directory, or tiny/tiny-moe.",
                            "check the spelling or the path.")
    report = hf_checkpoint.validate(target)
    print(f"checkpoint ready: {target} ({len(report.tensors)} tensors, "
          f"{'MoE ' if report.arch.is_moe else ''}{report.arch.num_hidden_layers} layers)")
    return target


def _rebuild(name: str, target: Path) -> dict:
    with atomic_directory(target.parent / ".rebuild") as tmp:
        provenance = embedded.bootstrap(name, tmp / "hf")
        shutil.rmtree(target)
        os.rename(tmp / "hf", target)
    return provenance


def _import_local(source: Path, target: Path, replace: bool) -> None:
    hf_checkpoint.validate(source)
    with atomic_directory(target, replace=replace) as tmp:
        for item in source.iterdir():
            if item.is_file() and (item.suffix in (".json", ".safetensors", ".txt", ".model") or "tokenizer" in item.name):
                shutil.copy2(item, tmp / item.name)
    print(f"imported {source} → {target}")


def _download_hub(repo_id: str, revision: str | None, target: Path, replace: bool) -> None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError

    pinned = known_models().get(repo_id, {}).get("revision")
    revision = revision or pinned or "main"
    if revision == "main":
        print(f"warning: {repo_id} is not pinned to a commit (revision 'main'); pin it in configs/models.toml.")
    # A stable staging folder, not a temp dir: an interrupted download resumes from it.
    staging = target.parent / ".hf-download"
    token_set = bool(os.environ.get("HF_TOKEN"))
    print(f"downloading {repo_id}@{revision} ({'with' if token_set else 'without'} HF_TOKEN) …")
    try:
        snapshot_download(repo_id, revision=revision, allow_patterns=HUB_PATTERNS, local_dir=staging)
    except LocalEntryNotFoundError as err:
        raise PipelineError(f"{repo_id} is not in the local cache and the Hub cannot be reached (HF_HUB_OFFLINE or no network).",
                            "run once with network access, or give MODEL as a local directory.") from err
    except HFValidationError as err:
        raise PipelineError(f"MODEL={repo_id!r} is not a valid Hub id.", "give it as org/name, e.g. Qwen/Qwen3-0.6B.") from err
    except HfHubHTTPError as err:
        raise PipelineError(f"the Hub refused {repo_id}@{revision}: {err.__class__.__name__}.",
                            "check the repo id and revision, and HF_TOKEN for gated repos.") from err
    (staging / "download.json").write_text(json.dumps({"repo_id": repo_id, "revision": revision}) + "\n")
    hf_checkpoint.validate(staging)
    with atomic_directory(target, replace=replace) as tmp:
        for item in staging.iterdir():
            if item.is_file():
                os.rename(item, tmp / item.name)
    shutil.rmtree(staging, ignore_errors=True)
