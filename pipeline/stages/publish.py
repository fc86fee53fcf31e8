"""Stage `publish` (opt-in): a run's verified export to a Hugging Face Hub model repository.

huggingface_hub's create_repo (private unless --public) and upload_folder, authenticated by HF_TOKEN
from the environment or `hf auth login`, never printed. Only an export that verify passed, unchanged
since (manifest.json's hashes, the verdict verify records there), is published: a team never receives
weights nobody checked. --dry-run says what would be uploaded where, with no network. The commit is
recorded in the run's published.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

from pipeline import envvars
from pipeline.checkpoint import manifest
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.models import registry
from pipeline.run import store

PUBLISHED = "published.json"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True)
    parser.add_argument("--path", required=True, choices=registry.names(), help="training path of the run")
    parser.add_argument("--name", help="the run's name (RUN_NAME; default: the path's name)")
    parser.add_argument("--repo", required=True, help="Hub repository id, <user or org>/<name>")
    parser.add_argument("--public", action="store_true", help="create the repository public (default: private)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be uploaded; no network")


def run(args: argparse.Namespace) -> dict:
    if args.repo.count("/") != 1 or not all(args.repo.split("/")):
        raise PipelineError(f"HUB_REPO={args.repo!r} is not a Hub repository id.", "give <user or org>/<name>.")
    run_dir = store.home(args.model).run(args.name or args.path)
    export = run_dir.export
    again = f"make export verify-checkpoint MODEL={args.model} TRAIN_PATH={args.path}" + \
            (f" RUN_NAME={args.name}" if args.name else "") + " FORCE=1"
    if not export.is_dir():
        raise PipelineError(f"{export} does not exist: nothing to publish.", f"run `{again}` first.")
    listed = manifest.check(export)  # every file exactly as exported (and verified)
    verdict = listed.get("verify") or {}
    if verdict.get("passed") is not True:
        said = "was never verified" if not verdict else f"failed verify ({verdict.get('detail')})"
        raise PipelineError(f"{export} {said}; only a verified export is published.", f"run `{again}`.")
    files = sorted([*listed["files"], manifest.MANIFEST])
    size = sum(entry["bytes"] for entry in listed["files"].values())
    visibility = "public" if args.public else "private"
    print(f"{'would publish' if args.dry_run else 'publishing'} {export} ({len(files)} files, {size / 2**20:.1f} MiB, "
          f"step {listed['step']}, {listed['dtype']}) → {args.repo} ({visibility})", flush=True)
    if args.dry_run:
        for name in files:
            print(f"  {name}")
        return {"repo": args.repo, "files": files, "dry_run": True}
    return _upload(args, export, files, listed, run_dir)


def _upload(args, export, files: list[str], listed: dict, run_dir) -> dict:
    from huggingface_hub import HfApi, get_token
    from huggingface_hub.errors import HfHubHTTPError

    token = os.environ.get(envvars.HF_TOKEN) or get_token()
    if not token:
        raise PipelineError("publishing needs a Hugging Face token with write access.",
                            "export HF_TOKEN=<a write token> (or `hf auth login`); it is never printed.")
    api = HfApi(token=token)
    message = f"{run_dir.path.name}: step {listed['step']} of {args.model} ({args.path} path), verified"
    try:
        api.create_repo(args.repo, visibility="public" if args.public else "private", exist_ok=True, repo_type="model")
        commit = api.upload_folder(repo_id=args.repo, folder_path=str(export), allow_patterns=files,
                                   commit_message=message, repo_type="model")
    except HfHubHTTPError as err:
        status = err.response.status_code if err.response is not None else "?"
        fix = ("HF_TOKEN must be a write token of an account allowed to write to that repository."
               if status in (401, 403) else "check HUB_REPO and the Hub's status, then rerun: unchanged files are skipped.")
        said = f": {err.server_message}" if getattr(err, "server_message", None) else ""
        raise PipelineError(f"the Hub refused the upload to {args.repo} (HTTP {status}){said}.", fix) from None
    record = {"repo": args.repo, "commit": commit.oid, "url": commit.commit_url, "files": files,
              "step": listed["step"], "dtype": listed["dtype"], "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(run_dir.path / PUBLISHED, json.dumps(record, indent=2) + "\n")
    print(f"published {args.repo} at commit {commit.oid} ({commit.commit_url})")
    return record
