"""DATASET=: a user's file, a torchtitan dataset or a Hub dataset id, checked in the launcher before
any rank starts and read in the ranks through torchtitan's dataset registry."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.titan import api
from pipeline.data import dataset
from helpers import cli
from tiny_checkpoint import ok, one_error_line


MARKER = "Zebras quietly audit the lighthouse ledger every Thursday"


def user_jsonl(directory: Path) -> Path:
    path = directory / "mine.jsonl"
    lines = [json.dumps({"text": f"{MARKER}, entry {i}: the keeper counts {i} boats and {i + 1} gulls."})
             for i in range(40)]
    path.write_text("\n".join(lines) + "\n")
    return path


# ---- resolution and checks in the launcher (no torch) --------------------------------------------

def test_kinds(tmp_path):
    local = tmp_path / "train.jsonl"
    local.write_text('{"text": "a"}\n')
    assert dataset.resolve("local", local) == dataset.DataSource("file", "local", str(local))
    assert dataset.resolve("c4_test", local, check_local=False).kind == "titan"
    assert dataset.resolve("c4", local, check_local=False).loader_name == dataset.REGISTERED_NAME["staged"]
    hub = dataset.resolve("someorg/my_corpus-v2", local)
    assert hub.kind == "hub" and hub.loader_name == dataset.REGISTERED_NAME["hub"]
    text = tmp_path / "notes.txt"
    text.write_text("one paragraph\n\nanother\n")
    assert dataset.resolve(str(text), local) == dataset.DataSource("file", str(text), str(text.resolve()))


@pytest.mark.parametrize("content, problem", [
    ("", "is empty"),
    ('{"text": "fine"}\nnot json\n', "mine.jsonl:2 is not JSON"),
    ('{"text": "fine"}\n\n{"body": "x"}\n', "mine.jsonl:3 has no \"text\" string (keys: ['body'])"),
    ('["a list"]\n', "mine.jsonl:1 has no \"text\" string"),
    ('{"text": 3}\n', "has no \"text\" string"),
])
def test_bad_jsonl_is_refused_naming_the_line(tmp_path, content, problem):
    path = tmp_path / "mine.jsonl"
    path.write_text(content)
    with pytest.raises(PipelineError) as err:
        dataset.resolve(str(path), tmp_path / "unused.jsonl")
    assert problem in err.value.problem


def test_long_lines_across_read_chunks_are_checked_whole(tmp_path):
    path = tmp_path / "long.jsonl"
    path.write_text("\n\n".join(json.dumps({"text": "word " * 9000}) for _ in range(7)))  # ~45 kB per line
    assert dataset.resolve(str(path), tmp_path / "unused.jsonl").kind == "file"
    path.write_text("\n".join([json.dumps({"text": "word " * 9000})] * 3 + ['{"no": "text"}']))
    with pytest.raises(PipelineError, match="long.jsonl:4 has no"):
        dataset.resolve(str(path), tmp_path / "unused.jsonl")


def test_unusable_values_are_refused(tmp_path):
    local = tmp_path / "train.jsonl"
    for value, problem in [
        ("c4x", "is not 'local', a .jsonl/.txt file, a torchtitan dataset (c4, c4_test, c4_validation) or a Hub"),
        ("a/b/c", "is not 'local'"),
        (str(tmp_path / "absent.jsonl"), "does not exist"),
        (str(tmp_path), "is a dataset directory and it has not been copied"),
        ("local", "does not exist (DATASET=local)"),
    ]:
        with pytest.raises(PipelineError) as err:
            dataset.resolve(value, local)
        assert problem in err.value.problem, (value, err.value.problem)
    csv = tmp_path / "data.csv"
    csv.write_text("text\nhello\n")
    with pytest.raises(PipelineError, match="only .jsonl, .txt are read"):
        dataset.resolve(str(csv), local)
    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"\xff\xfe\x00" * 100)
    with pytest.raises(PipelineError, match="is not UTF-8 text"):
        dataset.resolve(str(binary), local)


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads files whatever their mode")
def test_unreadable_file_is_refused(tmp_path):
    unreadable = tmp_path / "secret.jsonl"
    unreadable.write_text('{"text": "x"}\n')
    unreadable.chmod(0)
    with pytest.raises(PipelineError, match="is not readable"):
        dataset.resolve(str(unreadable), tmp_path / "train.jsonl")


def test_dry_run_does_not_need_local_data_but_checks_a_users_file(tmp_path):
    assert dataset.resolve("local", tmp_path / "absent.jsonl", check_local=False).kind == "file"


def _c4_test(root: Path, texts=("{}",)) -> Path:
    """torchtitan's c4_test under `root` as the installed torchtitan reads it: a folder (0.3.0) or its
    data.json (main), of JSON lines with a "text"."""
    read = root / api.titan_datasets()["c4_test"]
    data = read if read.suffix else read / "data.json"
    data.parent.mkdir(parents=True)
    data.write_text("".join(t + "\n" for t in texts))
    return read


def test_c4_test_outside_a_torchtitan_checkout_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(PipelineError, match="found neither in .* nor in the installed torchtitan's source checkout"):
        dataset.resolve("c4_test", tmp_path / "train.jsonl")
    assert dataset.resolve("c4_test", tmp_path / "train.jsonl", check_local=False).file is None  # the ranks look
    read = _c4_test(tmp_path)
    source = dataset.resolve("c4_test", tmp_path / "train.jsonl")
    assert source.kind == "titan" and source.file == str(read.resolve())


def test_c4_test_is_found_in_the_installed_torchtitans_checkout_as_the_tokenizer_is(tmp_path, monkeypatch):
    """The image's working directory (/opt/pipeline) has no tests/assets; torchtitan-neuron's clone, which it
    is installed from, does: the ranks are given that absolute path, and torchtitan's own c4_test entry
    reads it from any working directory."""
    from torchtitan.hf_datasets.text_datasets import DATASETS

    from pipeline.titan import assets

    checkout = tmp_path / "torchtitan-neuron"
    read = _c4_test(checkout, ['{"text": "first c4 document"}', '{"text": "second"}'])
    monkeypatch.setattr(assets, "checkout_root", lambda: checkout)
    elsewhere = tmp_path / "opt-pipeline"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    source = dataset.resolve("c4_test", elsewhere / "train.jsonl")
    assert source.file == str(read.resolve())
    monkeypatch.setitem(DATASETS, "c4_test", DATASETS["c4_test"])  # restored after the test
    assert dataset.register(source) == "c4_test"
    assert api.registered_dataset_paths()["c4_test"] == str(read.resolve())
    if not api.folded_batch():  # 0.3.0's entry loads itself: the documents, read from the checkout
        config = DATASETS["c4_test"]
        assert [config.sample_processor(r) for r in config.loader(config.path)] == ["first c4 document", "second"]


def test_titan_dataset_names_match_the_installed_torchtitan():
    # torchtitan's own entries; the pipeline's (dataset.REGISTERED_NAME) may already be registered by another test.
    ours = set(dataset.REGISTERED_NAME.values())
    installed = {name: path for name, path in api.registered_dataset_paths().items() if name not in ours}
    assert api.titan_datasets() == installed


def test_trn2_default_stays_c4():
    from pipeline.run import settings

    assert settings.load("trn2", "native", ("hf", "native", "nki")).dataset == "c4"
    assert settings.load("cpu", "native", ("hf", "native", "nki")).dataset == "local"


# ---- registration in a rank: torchtitan's own loader reads the file --------------------------------

@pytest.mark.parametrize("suffix", [".jsonl", ".txt"])
def test_torchtitan_loader_reads_a_registered_file(tmp_path, suffix):
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from pipeline.checkpoint.embedded import tokenizer_dir

    docs = [f"{MARKER} number {i}, with enough words to fill a short window." for i in range(6)]
    path = tmp_path / f"mine{suffix}"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs) if suffix == ".jsonl" else "\n\n".join(docs))
    source = dataset.resolve(str(path), tmp_path / "unused.jsonl")
    name = dataset.register(source)
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir()))
    loader = api.build_text_loader(api.text_dataloader(source, name), tokenizer=tokenizer, seq_len=64,
                                   local_batch_size=1)
    first, _labels = next(iter(loader))
    text = tokenizer.decode(first["input"].flatten().tolist())
    assert text.count(MARKER) >= 2, text  # documents, not lines or characters, are the samples
    assert "number 0" in text and "number 1" in text


# ---- the stage, as a user runs it -----------------------------------------------------------------

def test_a_bad_user_file_is_refused_before_launch(tiny_root, tmp_path):
    bad = tmp_path / "mine.jsonl"
    bad.write_text('{"content": "no text key"}\n')
    result = cli("train", "--model", "tiny", "--path", "native", "--dataset", str(bad), "--fresh",
                          root=tiny_root)
    assert "mine.jsonl:1 has no \"text\" string" in one_error_line(result)
    assert not (tiny_root / "tiny" / "runs" / "native" / "run.json").exists()  # nothing launched
    assert "launching" not in result.stdout


def test_training_reads_the_users_file(tiny_root, tmp_path):
    """Two real steps on tiny with DATASET=<file>: the recorded first batch is that file's text."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    mine = user_jsonl(tmp_path)
    result = ok(cli("train", "--model", "tiny", "--path", "native", "--dataset", str(mine), "--steps", "2",
                             "--nproc-per-node", "1", "--fresh", root=tiny_root))
    run_dir = tiny_root / "tiny" / "runs" / "native"
    spec = json.loads((run_dir / "run.json").read_text())
    assert spec["settings"]["dataset"] == str(mine) and spec["data_kind"] == "file"
    assert spec["data_file"] == str(mine.resolve())
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2], result.stdout[-2000:]
    batch = load_file(str(run_dir / "first_batch" / "rank0.safetensors"))
    tokenizer = Tokenizer.from_file(str(tiny_root / "tiny" / "source" / "tokenizer.json"))
    text = tokenizer.decode(batch["input"].flatten().tolist())
    assert MARKER in text and "lighthouse ledger" in text, text[:500]
    held_out = (tiny_root / "tiny" / "data" / "train.jsonl").read_text()
    assert MARKER not in held_out  # the default data could not have produced it


def test_every_line_is_read_strictly_before_launch(tmp_path):
    """A dry run reads what the ranks will, all of it: invalid UTF-8 (datasets' json builder refuses it) and
    a bad role far past the first lines are refused naming the line."""
    turns = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    chat_file = tmp_path / "chats.jsonl"
    chat_file.write_text("".join(json.dumps({"messages": turns}) + "\n" for _ in range(10))
                         + json.dumps({"messages": [turns[0], {"role": "bot", "content": "x"}]}) + "\n")
    with pytest.raises(PipelineError, match=r"chats.jsonl:11 message 2 has no role"):
        dataset.resolve(str(chat_file), tmp_path / "train.jsonl", check_local=False)
    text_file = tmp_path / "mine.jsonl"
    text_file.write_bytes(b'{"text": "fine"}\n' * 9 + b'{"text": "caf\xe9"}\n')
    with pytest.raises(PipelineError, match=r"mine.jsonl:10 is not UTF-8"):
        dataset.resolve(str(text_file), tmp_path / "train.jsonl", check_local=False)
