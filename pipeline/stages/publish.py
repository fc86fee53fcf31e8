"""Stage `publish` (opt-in): a run's verified export to a Hugging Face Hub model repository.

huggingface_hub's create_repo (private unless --public) and upload_folder, authenticated by HF_TOKEN
from the environment or `hf auth login`, never printed. Only an export that verify passed, unchanged
since (manifest.json's hashes, the verdict verify records there), is published: a team never receives
weights nobody checked. --adapter publishes a LoRA run's adapters (export-adapter/, PEFT's layout) instead,
those of the verified export's step. --dry-run says what would be uploaded where, with no network. The commit is
recorded in the run's published.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from pipeline import envvars, flags
from pipeline.checkpoint import manifest
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.models import registry
from pipeline.outputs.publish import PublishRequest
from pipeline.run import rundir
from pipeline.run.ref import RunRef

PUBLISHED = "published.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    flags.add_flags(parser, RunRef, choices={"path": registry.names()})
    flags.add_flags(parser, PublishRequest)


def check_repo_id(repo: str) -> str:
    """HUB_REPO as the Hub accepts it (huggingface_hub's own validator), with its owner: a dry run refuses
    what the upload would."""
    from huggingface_hub.errors import HFValidationError
    from huggingface_hub.utils import validate_repo_id

    fix = "give <user or org>/<name>: letters, digits, '-', '_' and '.', at most 96 characters."
    if repo.count("/") != 1 or not all(repo.split("/")):
        raise PipelineError(f"HUB_REPO={repo!r} is not a Hub repository id (<user or org>/<name>).", fix)
    try:
        validate_repo_id(repo)
    except HFValidationError as err:
        raise PipelineError(f"HUB_REPO={repo!r} is not a Hub repository id ({str(err).rstrip('.')}).", fix) from None
    return repo


def run(args: argparse.Namespace) -> dict:
    request = PublishRequest(**flags.values(PublishRequest, args))
    check_repo_id(request.repo)
    run_dir = RunRef(**flags.values(RunRef, args)).run_dir()
    export = run_dir.export
    name = f" RUN_NAME={args.name}" if args.name else ""
    again = f"make export verify-checkpoint MODEL={args.model} TRAIN_PATH={args.path}{name} FORCE=1"
    if not export.is_dir():
        raise PipelineError(f"{export} does not exist: nothing to publish.", f"run `{again}` first.")
    listed = manifest.check(export)  # every file exactly as exported (and verified)
    verdict = listed.get("verify") or {}
    if verdict.get("passed") is not True:
        said = "was never verified" if not verdict else f"failed verify ({verdict.get('detail')})"
        raise PipelineError(f"{export} {said}; only a verified export is published"
                            f"{' (and the adapters of a verified one)' if request.adapter else ''}.", f"run `{again}`.")
    _check_linked_weights(run_dir, export, listed, again)
    if request.adapter:  # the adapters of that verified export's step: its difference from the base model
        adapters = run_dir.adapter_export
        again = f"make export ADAPTER=1 MODEL={args.model} TRAIN_PATH={args.path}{name} FORCE=1"
        if not adapters.is_dir():
            raise PipelineError(f"{adapters} does not exist: no adapters to publish.", f"run `{again}` first.")
        adapter_listed = manifest.check(adapters)
        if adapter_listed["step"] != listed["step"]:
            raise PipelineError(f"{adapters} holds step {adapter_listed['step']}'s adapters, the verified export step "
                                f"{listed['step']}.", f"run `{again}`.")
        export, listed = adapters, {**adapter_listed, "verify": verdict}
    files = sorted([*listed["files"], manifest.MANIFEST])
    size = sum(entry["bytes"] for entry in listed["files"].values())
    visibility = "public" if request.public else "private"
    print(f"{'would publish' if request.dry_run else 'publishing'} {export} ({len(files)} files, {size / 2**20:.1f} MiB, "
          f"step {listed['step']}, {listed['dtype']}) → {request.repo} ({visibility})", flush=True)
    if request.dry_run:
        for name in files:
            print(f"  {name}")
        return {"repo": request.repo, "files": files, "dry_run": True}
    return _upload(args, request, export, files, listed, run_dir)


def _check_linked_weights(run_dir, export: Path, listed: dict, again: str) -> None:
    """An export in the dtype the run saved links the run's step-N/hf shards: each must still have the
    sha256 the ranks recorded as they saved it. An export shard edited in place after verify, its
    manifest rewritten to match, changed the run's save with it, and only that record tells."""
    if listed.get("dtype") != listed.get("saved_dtype"):
        return  # a cast: new files, compared tensor by tensor with the (hash-checked) save by verify
    recorded = set(run_dir.recorded_hf_hashes(int(listed["step"])).values())
    # Which shards are the save's own files is told by the files (one inode), never by the manifest it could edit
    # too; a copy (a marked copy of an older save, or where the filesystem cannot link) changes no save.
    saved = {(f.stat().st_dev, f.stat().st_ino) for f in (run_dir.step_dir(int(listed["step"])) / rundir.HF_WEIGHTS)
             .glob("*.safetensors")}
    for name, entry in sorted(listed["files"].items()):
        shard = export / name
        if name.endswith(".safetensors") and (shard.stat().st_dev, shard.stat().st_ino) in saved \
                and entry["sha256"] not in recorded:
            raise PipelineError(f"{shard} is not a shard the run's ranks saved at step {listed['step']} "
                                f"(its sha256 is not in step-{listed['step']}/hf/.sha256.json): the export was "
                                "changed after it was verified.", f"run `{again}`.")


def _upload(args, request: PublishRequest, export, files: list[str], listed: dict, run_dir) -> dict:
    import httpx
    from huggingface_hub import HfApi, constants, get_token
    from huggingface_hub.errors import HfHubHTTPError, OfflineModeIsEnabled

    if constants.HF_HUB_OFFLINE:
        raise PipelineError("HF_HUB_OFFLINE is set: publishing needs the Hub; nothing uploaded.",
                            "unset HF_HUB_OFFLINE for `make publish` (DRY_RUN=1 lists the files offline).")
    token = os.environ.get(envvars.HF_TOKEN) or get_token()
    if not token:
        raise PipelineError("publishing needs a Hugging Face token with write access.",
                            "export HF_TOKEN=<a write token> (or `hf auth login`); it is never printed.")
    api = HfApi(token=token)
    what = "LoRA adapters of " if request.adapter else ""
    message = f"{run_dir.path.name}: {what}step {listed['step']} of {args.model} ({args.path} path), verified"
    try:
        api.create_repo(request.repo, visibility="public" if request.public else "private", exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=request.repo, folder_path=str(export), allow_patterns=files,
                                   commit_message=message, repo_type="model")
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "?"
        fix = ("HF_TOKEN must be a write token of an account allowed to write to that repository."
               if status in (401, 403) else "check HUB_REPO and the Hub's status, then rerun: unchanged files are skipped.")
        said = f": {err.server_message}" if getattr(err, "server_message", None) else ""
        raise PipelineError(f"the Hub refused the upload to {request.repo} (HTTP {status}){said}.", fix) from None
    except (OfflineModeIsEnabled, httpx.TransportError, OSError) as err:  # no network, DNS, a refused connection
        raise PipelineError(f"the Hub ({constants.ENDPOINT}) could not be reached to publish {request.repo} "
                            f"({type(err).__name__}: {err}); nothing recorded as published.",
                            "check the network (and HF_ENDPOINT), then rerun: unchanged files are skipped.") from None
    record = {"repo": request.repo, "commit": commit.oid, "url": commit.commit_url, "files": files,
              "step": listed["step"], "dtype": listed["dtype"], "adapter": request.adapter, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(run_dir.path / PUBLISHED, json.dumps(record, indent=2) + "\n")
    print(f"published {request.repo} at commit {commit.oid} ({commit.commit_url})")
    return record
