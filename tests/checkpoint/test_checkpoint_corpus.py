"""The embedded default's corpus comes from pinned inputs (transformers 5.16.0's docstrings), so tiny
is the same model on every machine: its fingerprint is the pinned one, it reads nothing from the
running interpreter's own library, and anything else is refused in one line."""

from __future__ import annotations

import sys
from importlib import metadata
from pathlib import Path

import pytest

from pipeline.checkpoint import corpus
from pipeline.errors import PipelineError


def test_the_corpus_is_the_pinned_one():
    assert corpus.fingerprint() == corpus.SHA256
    assert corpus.checked_fingerprint() == corpus.SHA256


def test_it_is_read_from_transformers_not_from_the_interpreter():
    root = corpus.transformers_dir()
    assert metadata.version("transformers") == corpus.TRANSFORMERS_VERSION
    assert root.name == "transformers" and not str(root).startswith(sys.base_prefix + "/lib/python")


def test_split_is_stable():
    docs = corpus.documents()
    held, pre = corpus.held_out_documents(), corpus.pretraining_documents()
    assert held == list(docs[::corpus.HELD_OUT_EVERY]) and len(held) + len(pre) == len(docs)
    assert all(len(d) >= corpus.MIN_CHARS for d in docs)
    # Note: transformers repeats some docstrings verbatim, so 1 of the 69 held-out documents also
    # occurs among the pretraining ones (the split is by position, not by text).


def test_another_corpus_is_refused(monkeypatch):
    monkeypatch.setattr(corpus, "documents", lambda: ("a different document " * 20,))
    with pytest.raises(PipelineError, match="not the pinned"):
        corpus.checked_fingerprint()


def test_another_transformers_is_refused(monkeypatch):
    real = metadata.version
    monkeypatch.setattr(corpus.metadata, "version", lambda name: "5.17.0" if name == "transformers" else real(name))
    with pytest.raises(PipelineError, match="read from transformers 5.16.0, this environment has 5.17.0"):
        corpus.transformers_dir()


def test_the_data_stage_writes_the_held_out_documents(tmp_path):
    import json

    from pipeline.data import data_files as data

    written = data.write_local_data(tmp_path / "train.jsonl")
    lines = [json.loads(line)["text"] for line in Path(written).read_text().splitlines()]
    assert lines == corpus.held_out_documents()
