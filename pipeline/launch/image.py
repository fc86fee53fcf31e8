"""The pipeline image's name and the lock it is built from.

The tag is qwen3-pipeline:lock-<12 hex>: the sha256 of requirements.lock, so a changed lock is a new
image; with a BASE_IMAGE other than the default, the base's name goes into the hash too, because the
image keeps the base's own versions of the packages it has (docker/wheelhouse.py). A lock whose every
line is one exact version, or a URL pinned to a full commit, then means one set of packages.
"""

from __future__ import annotations

import hashlib
import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.run.targets import DEFAULT_NEFF_CACHE

IMAGE_REPO = "qwen3-pipeline"
LOCK = Path(__file__).resolve().parent.parent.parent / "requirements.lock"


@dataclass(frozen=True)
class ImageLayout:
    """Where things are inside the pipeline image, as the Dockerfile makes them (tests/launch/test_launch_image.py
    reads each one back out of the Dockerfile)."""

    python: str = "/opt/pipeline-venv/bin/python"  # the venv the Dockerfile builds
    workdir: str = "/opt/pipeline"  # the project: Makefile, configs/, pipeline/
    checkpoints: str = "/checkpoints"  # PIPELINE_CHECKPOINTS
    hf_cache: str = "/hf-cache"  # HF_HOME; a host HF_HUB_CACHE is mounted at its hub/ (the default)
    # TorchNeuron's NEFF cache (TORCH_NEURONX_NEFF_CACHE_DIR): the host's persistent cache is bind-mounted there
    # so a second run with the same shapes does not recompile.
    compile_cache: str = DEFAULT_NEFF_CACHE
    uid: int = 1000  # the image's user (the base's own UID-1000 user where it has one)

    @property
    def record(self) -> str:  # what the build recorded: the packages, the differences from the lock
        return f"{self.workdir}/record"

    @property
    def lock(self) -> str:
        return f"{self.workdir}/requirements.lock"

    @property
    def hub_cache(self) -> str:
        return f"{self.hf_cache}/hub"


IMAGE = ImageLayout()
# The Neuron SDK 2.33 PyTorch training DLC, pinned by digest once `make pin` resolved it (configs/base-image.toml).
BASE_IMAGE_PIN = LOCK.parent / "configs" / "base-image.toml"


def pinned_base_image(path: Path = BASE_IMAGE_PIN) -> str:
    """configs/base-image.toml's reference, with its digest once one is recorded."""
    pin = tomllib.loads(Path(path).read_text())
    reference, digest = pin["reference"], pin.get("digest", "")
    if digest and not re.fullmatch(r"sha256:[0-9a-f]{64}", digest):
        raise PipelineError(f"{path}: digest {digest!r} is not sha256:<64 hex>.", "run `make pin` to record it, or clear it.")
    return f"{reference.split('@', 1)[0]}@{digest}" if digest else reference


DEFAULT_BASE_IMAGE = pinned_base_image()
COMMIT = re.compile(r"@([0-9a-f]{40})$")
# What the pipeline's own code imports and is tested against: a base image that ships another version of
# one of these is refused at build (docker/wheelhouse.py) and reported FAIL by doctor, naming both.
# Every other package the base has keeps the base's version (the DLC's Neuron stack is built together).
CORE_PACKAGES = ("torch", "transformers", "safetensors", "huggingface-hub", "datasets", "torchtitan")


def lock_sha256(lock: Path) -> str:
    try:
        return hashlib.sha256(Path(lock).read_bytes()).hexdigest()
    except FileNotFoundError as err:
        raise PipelineError(f"lock file {lock} does not exist.", "pass --lock with an existing file.") from err


def build_key(lock: Path | None = None, base_image: str | None = None) -> str:
    """12 hex naming what an image is built from: the lock, and a base image other than the default."""
    lock = lock or LOCK
    if base_image in (None, DEFAULT_BASE_IMAGE):
        return lock_sha256(lock)[:12]
    return hashlib.sha256(Path(lock).read_bytes() + b"\nbase-image: " + base_image.encode()).hexdigest()[:12]


def default_tag(lock: Path | None = None, base_image: str | None = None) -> str:
    return f"{IMAGE_REPO}:lock-{build_key(lock, base_image)}"


def check_lock(lock: Path) -> list:
    """Every requirement of the lock, or a one-line refusal: a line that is not exactly one version
    (a wildcard, a range) or a URL not pinned to a full commit (a branch, a tag, a placeholder)."""
    from packaging.requirements import InvalidRequirement, Requirement

    requirements = []
    for number, line in enumerate(Path(lock).read_text().splitlines(), 1):
        text = line.split("#", 1)[0].strip() if not line.lstrip().startswith("#") else ""
        if not text:
            continue
        where = f"{lock}:{number}"
        try:
            req = Requirement(text)
        except InvalidRequirement as err:
            raise PipelineError(f"{where}: {text!r} is not a requirement ({err}).", "write name==version.") from err
        if req.url:
            if not COMMIT.search(req.url):
                ref = req.url.rsplit("@", 1)[-1]
                raise PipelineError(f"{where}: {req.name} is pinned to {ref!r}, not a 40-hex commit, so the lock "
                                    "does not name one set of packages.",
                                    f"replace {ref!r} with the commit (git ls-remote {req.url.split('+', 1)[-1].rsplit('@', 1)[0]} "
                                    "<branch>) in the lock.")
        else:
            specs = list(req.specifier)
            if len(specs) != 1 or specs[0].operator != "==" or "*" in specs[0].version:
                raise PipelineError(f"{where}: {text!r} is not one exact version.", f"pin {req.name}==<version>.")
        requirements.append(req)
    return requirements
