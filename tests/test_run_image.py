"""pipeline/run/image.py: the image tag follows the lock's hash (no Docker engine needed)."""

import re

from pipeline.run import image


def test_tag_follows_the_lock(tmp_path):
    lock = tmp_path / "a.lock"
    lock.write_text("torch==2.14.0\n")
    first = image.default_tag(lock)
    lock.write_text("torch==2.14.1\n")
    assert image.default_tag(lock) != first
    assert re.fullmatch(r"qwen3-pipeline:lock-[0-9a-f]{12}", first)

