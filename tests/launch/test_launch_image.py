"""pipeline/launch/image.py: the image tag follows the lock's hash (no Docker engine needed)."""

import re
from pathlib import Path

from pipeline.launch import image


def test_tag_follows_the_lock(tmp_path):
    lock = tmp_path / "a.lock"
    lock.write_text("torch==2.14.0\n")
    first = image.default_tag(lock)
    lock.write_text("torch==2.14.1\n")
    assert image.default_tag(lock) != first
    assert re.fullmatch(r"qwen3-pipeline:lock-[0-9a-f]{12}", first)



def test_the_image_layout_is_the_dockerfiles():
    """Each path ImageLayout names is one the Dockerfile makes, so launch files and doctor point where
    the image really has things."""
    from helpers import REPO

    dockerfile = (REPO / "Dockerfile").read_text()
    layout = image.IMAGE
    assert f"-m venv {layout.python.removesuffix('/bin/python')} " in dockerfile
    assert f"WORKDIR {layout.workdir}\n" in dockerfile
    assert f"COPY pipeline/ {layout.workdir}/pipeline/" in dockerfile
    assert f"{layout.record}/" in dockerfile
    assert re.search(rf"^COPY [^\n]*\b{re.escape(Path(layout.lock).name)}\b[^\n]* {layout.workdir}/$", dockerfile, re.M)
    assert f"PIPELINE_CHECKPOINTS={layout.checkpoints} " in dockerfile and f"HF_HOME={layout.hf_cache} " in dockerfile
    assert f"TORCH_NEURONX_NEFF_CACHE_DIR={layout.compile_cache}" in dockerfile
    assert f"ARG PIPELINE_UID={layout.uid}\n" in dockerfile
