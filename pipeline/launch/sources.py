"""How a model's source checkpoint gets into the store (stage `download`): the embedded default made
here, a local directory copied, or a Hub snapshot at a pinned revision in the Hugging Face cache,
linked from <key>/source. Each is validated before source.json records it."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

from pipeline.checkpoint import embedded, hf_dir
from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory
from pipeline.run import store
from pipeline.run.expectation import known_models




REQUIRE_PINNED = envvars.REQUIRE_PINNED


COMMIT = re.compile(r"[0-9a-f]{40}")





def fetch(model: str, home: store.ModelHome, revision: str | None) -> Path:
    kind = home.source.kind
    if kind != "hub" and home.source_record.exists():
        home.source_record.unlink()  # source/ is about to be replaced: not downloaded until it is complete
    if kind == "embedded":
        with atomic_directory(home.local_source, replace=True) as tmp:
            provenance = embedded.bootstrap(model, tmp)
        print(f"made embedded {model}: pretraining loss {provenance['first_loss']:.3f} → {provenance['final_loss']:.3f}")
        home.write_record(corpus_sha256=provenance["corpus_sha256"])
    elif kind == "local":
        source = Path(home.source.path)
        with atomic_directory(home.local_source, replace=True) as tmp:
            for item in source.iterdir():
                if item.is_file() and (item.suffix in hf_dir.LOCAL_SUFFIXES or "tokenizer" in item.name):
                    shutil.copy2(item, tmp / item.name)
        home.write_record(path=home.source.path)
        print(f"imported {source} → {home.local_source}")
    else:
        commit = download_hub(home.source.repo_id, revision or "main")
        home.write_record(repo_id=home.source.repo_id, revision=revision or "main", commit=commit)
        link_hub_source(home)
    directory = home.source_dir()
    report = hf_dir.validate(directory)
    print(f"checkpoint ready: {directory} ({len(report.tensors)} tensors, "
          f"{'MoE ' if report.arch.is_moe else ''}{report.arch.num_hidden_layers} layers)")
    return directory


def revision(source: store.Source, asked: str | None) -> str | None:
    store.check_revision_applies(source, asked)
    if source.kind != "hub":
        return None
    revision = asked or known_models().get(source.repo_id, {}).get("revision")
    if os.environ.get(REQUIRE_PINNED, "0") not in ("", "0") and not COMMIT.fullmatch(revision or ""):
        raise PipelineError(
            f"{source.repo_id} would be downloaded at revision {revision or 'main'!r}, not a commit, and "
            f"{REQUIRE_PINNED} is set.",
            f"pin it in configs/models.toml: revision = the 40-hex sha printed by `python -c \"from huggingface_hub "
            f"import model_info; print(model_info('{source.repo_id}').sha)\"` (or REVISION=<sha>).")
    return revision


def link_hub_source(home: store.ModelHome) -> Path:
    """<key>/source → the Hub snapshot in the HF cache: the path a cluster's run.json names (launch), the
    same on every node that mounts the checkpoints root. Relative when the cache lives under that root (an
    HF_HOME on the shared filesystem), so the link holds at any mount point."""
    snapshot = home.source_dir()
    try:
        target = Path(os.path.relpath(snapshot, home.dir)) if snapshot.is_relative_to(home.root) else snapshot
    except ValueError:
        target = snapshot
    tmp = home.dir / ".source.link"
    tmp.unlink(missing_ok=True)
    tmp.symlink_to(target, target_is_directory=True)
    if home.local_source.is_dir() and not home.local_source.is_symlink():
        shutil.rmtree(home.local_source)
    os.replace(tmp, home.local_source)
    return home.local_source


def download_hub(repo_id: str, revision: str) -> str:
    """snapshot_download into the HF cache; returns the commit the revision resolved to. A failure
    leaves the previous download (and its source.json) as it was."""
    import httpx
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OfflineModeIsEnabled

    if revision == "main":
        print(f"warning: {repo_id} is not pinned to a commit (revision 'main'); pin it in configs/models.toml "
              "or pass REVISION=<commit>.")
    print(f"downloading {repo_id}@{revision} into the Hugging Face cache "
          f"({'with' if os.environ.get('HF_TOKEN') else 'without'} HF_TOKEN) …", flush=True)
    try:
        folder = snapshot_download(repo_id, revision=revision, allow_patterns=hf_dir.HUB_PATTERNS)
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx.TransportError) as err:
        # huggingface_hub answers from the cache when it can; this revision is not there (offline mode
        # raises OfflineModeIsEnabled for a commit it has not seen, a missing network httpx's ConnectError).
        why = "HF_HUB_OFFLINE is set" if os.environ.get("HF_HUB_OFFLINE") else f"{type(err).__name__}: no network?"
        raise PipelineError(f"{repo_id}@{revision} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                            f"and the Hub cannot be reached ({why}).",
                            "run once with network access, or give MODEL as a local directory.") from err
    except HFValidationError as err:
        raise PipelineError(f"MODEL={repo_id!r} is not a valid Hub id.", "give it as org/name, e.g. Qwen/Qwen3-0.6B.") from err
    except HfHubHTTPError as err:
        raise PipelineError(f"the Hub refused {repo_id}@{revision}: {err.__class__.__name__}.",
                            "check the repo id and revision, and HF_TOKEN for gated repos.") from err
    hf_dir.validate(Path(folder))
    return Path(folder).name  # snapshots/<commit>
