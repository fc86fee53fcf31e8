"""Resolve, once, what the trn2 stack is pinned to, and write each pin where it belongs (stage `pin`).

Three values could not be read where this repository was written (no GitHub, Hub or registry there), and
the trn2 workflow cannot run without them (`make image` refuses an unpinned lock; PIPELINE_REQUIRE_PINNED
refuses a Hub revision that is not a commit):

  torchtitan-neuron's commit   requirements.lock: `…torchtitan-neuron@COMMIT-UNKNOWN` → the commit the
                               release branch points at (`git ls-remote`)
  each Hub model's revision    configs/models.toml: `revision = "main"` → the commit `main` is at
                               (huggingface_hub.model_info)
  the base image's digest      configs/base-image.toml: `digest = ""` → the registry's manifest digest of
                               the reference (the Docker engine pulls it; BASE_IMAGE, when set, is the
                               reference resolved and recorded)

Every look-up runs before anything is written; then each file is rewritten atomically, and re-read to
prove only the pin changed. A value already pinned is kept, never re-resolved. What was resolved is
printed with the files to commit: those files, as this run leaves them, are the record (the workflow
prints their diff).
"""

from __future__ import annotations

import re
import subprocess
import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text
from pipeline.run import expectation, store
from pipeline.launch import image as image_names

LOCK = store.REPO / "requirements.lock"
MODELS_TOML = expectation.MODELS_TOML
BASE_IMAGE_PIN = image_names.BASE_IMAGE_PIN
PLACEHOLDER = "COMMIT-UNKNOWN"
# The fork and branch the Neuron 2.33 image's torchtitan comes from: "torchtitan-neuron release-2.33"
# (the reference recipe's pinned versions; awsdocs-neuron setup-torchtitan-neuron installs from a clone).
FORK_BRANCH = "release-2.33"
COMMIT = re.compile(r"[0-9a-f]{40}")
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class Pin:
    what: str  # what was pinned, as a reader names it
    value: str  # the commit or digest
    file: Path  # where it is recorded


@dataclass(frozen=True)
class Resolvers:
    """The network look-ups, each replaceable (tests give local stand-ins)."""

    branch_commit: Callable[[str, str], str]  # (repository URL, branch) -> 40-hex commit
    hub_commit: Callable[[str, str], str]  # (repo id, revision) -> 40-hex commit
    base_digest: Callable[[str], str]  # (image reference) -> sha256:<hex>


# ---- the look-ups ------------------------------------------------------------------------------------

def git_branch_commit(repository: str, branch: str) -> str:
    try:
        result = subprocess.run(["git", "ls-remote", repository, f"refs/heads/{branch}"], capture_output=True,
                                text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise PipelineError(f"`git ls-remote {repository}` could not run ({type(err).__name__}).",
                            "install git and check the network to GitHub.") from err
    found = result.stdout.split()
    if result.returncode != 0 or not found or not COMMIT.fullmatch(found[0]):
        said = (result.stderr.strip().splitlines() or ["no such branch"])[-1]
        raise PipelineError(f"`git ls-remote {repository} refs/heads/{branch}` gave no commit ({said}).",
                            "check the repository and branch (and the network to GitHub).")
    return found[0]


def hub_commit(repo_id: str, revision: str) -> str:
    from huggingface_hub import model_info

    try:
        return model_info(repo_id, revision=revision).sha
    except Exception as err:  # offline, gated, unknown id: huggingface_hub raises many kinds
        raise PipelineError(f"the Hub did not resolve {repo_id}@{revision} ({type(err).__name__}).",
                            "check the network, the id and HF_TOKEN for gated repos.") from err


def engine_base_digest(reference: str) -> str:
    """The manifest digest the registry gave for `reference`, pulling it when the engine lacks it (the
    pull `make image` does anyway; its one-line error when the base does not exist)."""
    from pipeline.host import image

    base = image.ensure_base(image.client(), reference)
    if not base.digest:
        raise PipelineError(f"base image {reference} has no registry digest (it was made locally).",
                            "pin a base pulled from a registry, or build with BASE_IMAGE= as it is.")
    return base.digest


NETWORK = Resolvers(branch_commit=git_branch_commit, hub_commit=hub_commit, base_digest=engine_base_digest)


# ---- what is unpinned, and the rewritten files ----------------------------------------------------------

def fork_line(lock_text: str) -> tuple[int, str] | None:
    """(index, line) of the lock's torchtitan line still ending in the placeholder, or None."""
    for index, line in enumerate(lock_text.splitlines()):
        if line.startswith("torchtitan @ git+") and line.rstrip().endswith(f"@{PLACEHOLDER}"):
            return index, line
    return None


def unpinned_models(models_text: str) -> dict[str, str]:
    """{Hub id: revision} of every model of configs/models.toml whose revision is not a commit."""
    return {model: entry.get("revision", "main") for model, entry in tomllib.loads(models_text).items()
            if isinstance(entry, dict) and not COMMIT.fullmatch(entry.get("revision", "main"))}


def with_model_revision(models_text: str, model: str, commit: str) -> str:
    """models.toml with `revision` of [model]'s table set to `commit`, every other byte kept."""
    lines = models_text.splitlines(keepends=True)
    header = f'["{model}"]'
    start = next(i for i, line in enumerate(lines) if line.strip() == header)
    for i in range(start + 1, len(lines)):
        if lines[i].lstrip().startswith("["):
            break
        if re.match(r"\s*revision\s*=", lines[i]):
            lines[i] = re.sub(r'=\s*"[^"]*"', f'= "{commit}"', lines[i], count=1)
            return "".join(lines)
    lines.insert(start + 1, f'revision = "{commit}"\n')
    return "".join(lines)


def with_base_digest(pin_text: str, reference: str, digest: str) -> str:
    text = re.sub(r'(?m)^reference\s*=\s*"[^"]*"', f'reference = "{reference}"', pin_text, count=1)
    return re.sub(r'(?m)^digest\s*=\s*"[^"]*"', f'digest = "{digest}"', text, count=1)


def _checked(path: Path, before: str, after: str, changed: dict[tuple, str]) -> str:
    """`after` parses, and differs from `before` in exactly the `changed` keys (paths of TOML keys)."""
    old, new = tomllib.loads(before), tomllib.loads(after)
    for keys, value in changed.items():
        table = old
        for key in keys[:-1]:
            table = table.setdefault(key, {})
        table[keys[-1]] = value
    if old != new:
        raise PipelineError(f"rewriting {path} would change more than its pins; nothing written.",
                            "fix the file by hand (its comments say what each pin holds).")
    return after


def resolve(resolvers: Resolvers = NETWORK, base_image: str | None = None, lock: Path = LOCK,
            models: Path = MODELS_TOML, base_pin: Path = BASE_IMAGE_PIN) -> list[Pin]:
    """Look every unpinned value up, then write them all; returns what was pinned (empty: nothing to do)."""
    lock_text, models_text, pin_text = lock.read_text(), models.read_text(), base_pin.read_text()
    writes: dict[Path, str] = {}
    pins: list[Pin] = []
    line = fork_line(lock_text)
    if line is not None:
        index, text = line
        repository = text.split("git+", 1)[1].rsplit("@", 1)[0]
        commit = resolvers.branch_commit(repository, FORK_BRANCH)
        lines = lock_text.splitlines(keepends=True)
        lines[index] = lines[index].replace(f"@{PLACEHOLDER}", f"@{commit}")
        writes[lock] = "".join(lines)
        pins.append(Pin(f"torchtitan-neuron {FORK_BRANCH}", commit, lock))
    new_models = models_text
    for model, revision in unpinned_models(models_text).items():
        commit = resolvers.hub_commit(model, revision)
        if not COMMIT.fullmatch(commit or ""):
            raise PipelineError(f"the Hub gave {commit!r} for {model}@{revision}, not a commit.", "try again.")
        new_models = _checked(models, new_models, with_model_revision(new_models, model, commit),
                              {(model, "revision"): commit})
        pins.append(Pin(f"{model} {revision}", commit, models))
    if new_models != models_text:
        writes[models] = new_models
    pin = tomllib.loads(pin_text)
    recorded = pin["reference"].split("@", 1)[0]
    reference = (base_image or recorded).split("@", 1)[0]
    if base_image and "@" in base_image:  # given pinned already: recorded as given
        digest = base_image.split("@", 1)[1]
    elif pin.get("digest") and reference == recorded:
        digest = None  # pinned: kept
    else:
        digest = resolvers.base_digest(reference)
    if digest is not None and (digest, reference) != (pin.get("digest"), recorded):
        if not DIGEST.fullmatch(digest):
            raise PipelineError(f"base image {reference} resolved to {digest!r}, not sha256:<64 hex>.", "try again.")
        writes[base_pin] = _checked(base_pin, pin_text, with_base_digest(pin_text, reference, digest),
                                    {("reference",): reference, ("digest",): digest})
        pins.append(Pin(f"base image {reference}", digest, base_pin))
    for path, text in writes.items():
        atomic_write_text(path, text)
    return pins
