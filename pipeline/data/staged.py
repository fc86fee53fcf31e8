"""Datasets staged once into the checkpoints root (stage `data`), which every rank then reads from there.

torchtitan's registry streams `c4` (allenai/c4) from the Hub in every rank: 64 streams a node, unpinned,
and the Hub answers such bursts with HTTP 429 and waits of ~200 s (pytorch/torchtitan#2239), longer than
the collective timeout. `make data DATASET=c4 [DATA_SHARDS=N] [DATASET_REVISION=<commit>]` instead copies
N of its train shards (`en/c4-train.0000X-of-01024.json.gz`, JSON lines of text/timestamp/url) once, at a
revision resolved to a commit, into <root>/data/sets/c4/ with a record (source.json: repository, revision,
commit, every shard's path, size and sha256). The ranks read those files with datasets' json builder
(which reads .json.gz); the launch files run this stage once before the ranks start
(pipeline.launch.cluster). A rerun with nothing asked that differs only checks the files.

The files come through huggingface_hub (`dataset_info` for the commit, `hf_hub_download` per shard); a
local directory laid out like the Hub repository (DATASET_MIRROR=<dir>: a mirror on the shared file
system, or the tests' stand-in) is read in its place.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from pipeline import envvars
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_directory, atomic_write_text

SETS = Path("data") / "sets"  # under the checkpoints root: shared by every model
RECORD = "source.json"
COMMIT = re.compile(r"[0-9a-f]{40}")


@dataclass(frozen=True)
class ShardedSet:
    """A Hub dataset read as its first N shard files."""

    repo_id: str
    shard: str  # the i-th shard's path in the repository
    total: int  # shards the repository has
    default_shards: int
    # No commit of allenai/c4 could be confirmed from here: "main" is resolved to a commit when staged and
    # recorded; PIPELINE_REQUIRE_PINNED refuses it (DATASET_REVISION=<commit> pins it).
    revision: str = "main"

    def paths(self, count: int) -> list[str]:
        return [self.shard.format(i) for i in range(count)]


# allenai/c4's layout: https://huggingface.co/datasets/allenai/c4/tree/main/en (1024 train shards of ~320 MB).
SHARDED = {"c4": ShardedSet("allenai/c4", "en/c4-train.{:05d}-of-01024.json.gz", 1024, 8)}


def set_dir(root: Path, name: str) -> Path:
    return Path(root) / SETS / name


# ---- where the shards come from -------------------------------------------------------------------------

class HubShards:
    """The Hub repository through huggingface_hub."""

    def __init__(self, repo_id: str):
        self.repo_id = repo_id

    def describe(self) -> str:
        return f"hf://datasets/{self.repo_id}"

    def commit(self, revision: str) -> str:
        from huggingface_hub import HfApi

        try:
            return HfApi().dataset_info(self.repo_id, revision=revision).sha
        except Exception as err:  # offline, unknown revision, gated: huggingface_hub raises many kinds
            raise _unreachable(self.repo_id, revision, err) from err

    def fetch(self, path: str, commit: str, into: Path) -> Path:
        from huggingface_hub import hf_hub_download

        try:
            return Path(hf_hub_download(self.repo_id, path, repo_type="dataset", revision=commit, local_dir=into))
        except Exception as err:
            raise _unreachable(self.repo_id, commit, err, path) from err


class DirectoryShards:
    """A local directory laid out like the Hub repository; its revision is the one it is said to mirror."""

    def __init__(self, directory: Path):
        self.directory = Path(directory).expanduser().resolve()
        if not self.directory.is_dir():
            raise PipelineError(f"DATASET_MIRROR={directory} is not a directory.",
                                "give a directory laid out like the Hub repository (e.g. en/c4-train.00000-of-01024.json.gz).")

    def describe(self) -> str:
        return str(self.directory)

    def commit(self, revision: str) -> str:
        return revision

    def fetch(self, path: str, commit: str, into: Path) -> Path:
        found = self.directory / path
        if not found.is_file():
            raise PipelineError(f"DATASET_MIRROR={self.directory} has no {path}.",
                                "give fewer DATA_SHARDS, or a mirror holding them.")
        target = into / path
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(found, target)
        return target


def _unreachable(repo_id: str, revision: str, err: Exception, path: str | None = None) -> PipelineError:
    what = f"{repo_id}@{revision}{f' ({path})' if path else ''}"
    return PipelineError(f"the Hub dataset {what} cannot be read from here: {type(err).__name__}: "
                         f"{str(err).splitlines()[0] if str(err) else ''}",
                         "check the network and DATASET_REVISION (HF_TOKEN for gated sets), or give "
                         "DATASET_MIRROR=<a local copy laid out like the repository>.")


# ---- staging --------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Staged:
    directory: Path
    record: dict
    reused: bool

    @property
    def files(self) -> list[Path]:
        return [self.directory / shard["path"] for shard in self.record["shards"]]


def stage(root: Path, name: str, shards: int | None = None, revision: str | None = None,
          mirror: Path | None = None) -> Staged:
    """The set `name` in <root>/data/sets/<name>/: kept when its record already holds what is asked
    (None: whatever it holds) and every file's sha256 still matches, else copied again, atomically."""
    known = SHARDED[name]
    directory = set_dir(root, name)
    existing = read_record(directory)
    # Nothing asked: what is staged (copied again, the same shards at the same commit, if a file changed).
    count = shards if shards is not None else len(existing["shards"]) if existing else known.default_shards
    if not 1 <= count <= known.total:
        raise PipelineError(f"DATA_SHARDS={count}: {known.repo_id} has {known.total} train shards.",
                            f"give 1 to {known.total}.")
    if existing is not None and len(existing["shards"]) == count and \
            revision in (None, existing["revision"], existing["commit"]) and _files_match(directory, existing):
        return Staged(directory, existing, reused=True)
    asked = revision or (existing["commit"] if existing else known.revision)
    if os.environ.get(envvars.REQUIRE_PINNED, "0") not in ("", "0") and not COMMIT.fullmatch(asked):
        raise PipelineError(f"DATASET={name} would be staged from {known.repo_id} at revision {asked!r}, not a commit, "
                            f"and {envvars.REQUIRE_PINNED} is set.",
                            "give DATASET_REVISION=<the 40-hex sha of `huggingface_hub.dataset_info("
                            f"'{known.repo_id}').sha`>.")
    source = DirectoryShards(mirror) if mirror else HubShards(known.repo_id)
    commit = source.commit(asked)
    from pipeline.checkpoint import manifest

    with atomic_directory(directory, replace=True) as tmp:
        listed = []
        for path in _progress(known.paths(count), f"staging {name}"):
            copied = source.fetch(path, commit, tmp)
            listed.append({"path": path, "bytes": copied.stat().st_size, "sha256": manifest.sha256(copied)})
        shutil.rmtree(tmp / ".cache", ignore_errors=True)  # hf_hub_download's own bookkeeping under local_dir
        record = {"dataset": name, "repo_id": known.repo_id, "repo_type": "dataset", "revision": asked,
                  "commit": commit, "source": source.describe(), "shards": listed}
        atomic_write_text(tmp / RECORD, json.dumps(record, indent=2) + "\n")
    return Staged(directory, record, reused=False)


def _progress(items: list, desc: str):
    from tqdm import tqdm

    return tqdm(items, desc=desc, unit="shard", disable=len(items) < 2)


def read_record(directory: Path) -> dict | None:
    """The set's record, or None when there is none this code wrote."""
    from pipeline.fsutil import read_small_text

    try:
        record = json.loads(read_small_text(Path(directory) / RECORD))
        if all(isinstance(s.get("path"), str) and isinstance(s.get("sha256"), str) for s in record["shards"]) \
                and record["shards"]:
            return record
    except (OSError, ValueError, TypeError, KeyError, AttributeError, PipelineError):
        pass
    return None


def _files_match(directory: Path, record: dict) -> bool:
    from pipeline.checkpoint import manifest

    return all((directory / s["path"]).is_file() and manifest.sha256(directory / s["path"]) == s["sha256"]
               for s in record["shards"])


def shard_files(directory: Path, name: str, check_sha256: bool = False) -> list[str]:
    """The staged files a run reads (its record's list), refused in one line when the set is not
    staged or a file is missing (changed, with `check_sha256`: what FRESH=1 reads before it deletes)."""
    directory = Path(directory)
    record = read_record(directory)
    fix = f"run `make data DATASET={name}` (it stages the set once into the checkpoints root)."
    if record is None:
        raise PipelineError(f"DATASET={name} is read from its staged copy {directory}, which holds no record "
                            f"({RECORD}): it is not staged.", fix)
    for shard in record["shards"]:
        path = directory / shard["path"]
        if not path.is_file():
            raise PipelineError(f"DATASET={name}: staged file {path} is missing.", fix)
        if check_sha256:
            from pipeline.checkpoint import manifest

            if manifest.sha256(path) != shard["sha256"]:
                raise PipelineError(f"DATASET={name}: staged file {path} is not the one staged (sha256 differs "
                                    f"from {RECORD}).", fix)
    return [str(directory / shard["path"]) for shard in record["shards"]]
