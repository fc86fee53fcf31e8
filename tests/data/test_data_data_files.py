"""data/data_files.py: the embedded data files are re-cut only when they are not what the code makes."""

from __future__ import annotations

import json

from pipeline.checkpoint import corpus
from pipeline.data import data_files


def test_embedded_data_is_reused_only_while_its_stamp_matches(tmp_path, monkeypatch):
    train = tmp_path / "train.jsonl"
    first = data_files.write_embedded_data(train)
    assert not first.reused and first.counts["documents"] == len(corpus.held_out_documents())
    made = {p: p.read_bytes() for p in (first.train, first.chat, first.chat_eval)}

    cuts = []
    real = data_files.write_local_data
    monkeypatch.setattr(data_files, "write_local_data", lambda path: cuts.append(path) or real(path))
    again = data_files.write_embedded_data(train)
    assert again.reused and again.counts == first.counts and cuts == []

    # An edited (or half-written) file is made again, and so is everything after the code that cuts them changes.
    first.chat.write_text("{}\n")
    assert not data_files.write_embedded_data(train).reused and cuts == [train]
    assert {p: p.read_bytes() for p in made} == made
    stamp = train.with_name(data_files.EMBEDDED_STAMP)
    recorded = json.loads(stamp.read_text())
    recorded["maker"]["maker_sha256"] = "0" * 64
    stamp.write_text(json.dumps(recorded))
    assert not data_files.write_embedded_data(train).reused and len(cuts) == 2
    assert data_files.write_embedded_data(train).reused


def test_a_stamp_that_is_not_ours_means_the_files_are_cut_again(tmp_path):
    train = tmp_path / "train.jsonl"
    data_files.write_embedded_data(train)
    stamp = train.with_name(data_files.EMBEDDED_STAMP)
    for foreign in ("[1, 2]", "{}", '{"maker": 3}', "not json"):
        stamp.write_text(foreign)
        assert not data_files.write_embedded_data(train).reused, foreign
        assert data_files.write_embedded_data(train).reused
