"""pipeline/stages/data.py: a Hub dataset's split copied for fine-tuning, columns renamed, checked.

The Hub is unreachable here, so the dataset is a local directory laid out as the Hub's parquet
conversion lays out a repository (data/<split>-00000-of-00001.*): `datasets.load_dataset` reads it
through the same call and the same split inference as a Hub id."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.data import dataset
from helpers import REPO, read_metrics, run_dir, run_pipeline


def hub_shaped(directory: Path, train: list[dict], test: list[dict]) -> Path:
    (directory / "data").mkdir(parents=True)
    for split, rows in (("train_sft", train), ("test_sft", test)):
        (directory / "data" / f"{split}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


def conversation(i: int) -> dict:
    return {"id": i, "conversations": [{"role": "system", "content": "Be brief."},
                                       {"role": "user", "content": f"Count to {i}."},
                                       {"role": "assistant", "content": " ".join(str(n) for n in range(1, i + 2))},
                                       {"role": "user", "content": "Again?"},
                                       {"role": "assistant", "content": "Once more: " + str(i)}]}


@pytest.fixture
def chat_set(tmp_path) -> Path:
    return hub_shaped(tmp_path / "ultrachat-like", [conversation(i) for i in range(24)],
                      [conversation(3 + 2 * i) for i in range(4)])


def copy(root: Path, dataset: Path, *extra: str, check=True):
    return run_pipeline("data", "--model", "tiny", "--dataset", str(dataset), *extra, root=root, check=check)


def test_a_split_is_copied_with_its_columns_renamed_and_read_as_chat(chat_set, tmp_path):
    root = tmp_path / "ckpt"
    done = copy(root, chat_set, "--split", "train_sft", "--eval-split", "test_sft", "--columns", "messages=conversations")
    out = root / "tiny" / "data" / "hub" / "ultrachat-like.jsonl"
    assert f"24 chat records → {out}" in done.stdout
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert records[3] == {"messages": conversation(3)["conversations"]}  # renamed; other columns dropped
    held = [json.loads(line) for line in out.with_suffix(".eval.jsonl").read_text().splitlines()]
    assert len(held) == 4 and held[0]["messages"][1]["content"] == "Count to 3."
    assert json.loads(out.with_suffix(".json").read_text())["split"] == "train_sft"
    source = dataset.resolve(str(chat_set), root / "tiny" / "data" / "train.jsonl")
    assert (source.kind, source.file, source.format) == ("file", str(out), "chat")
    settings = type("S", (), {"eval_every": 5, "eval_steps": 1, "eval_dataset": ""})()
    assert dataset.eval_file(settings, source, root / "tiny" / "data" / "train.jsonl") == str(out.with_suffix(".eval.jsonl"))
    # copied again without an eval split: the old eval copy does not outlive the copy it belonged to
    copy(root, chat_set, "--split", "train_sft", "--columns", "messages=conversations", "--hold-out", "0")
    assert not out.with_suffix(".eval.jsonl").exists()
    # nor with the default held-out split of chat data (EVAL_SPLIT): then it is records held out of this copy
    copy(root, chat_set, "--split", "train_sft", "--columns", "messages=conversations")
    held, train = (f.read_text().splitlines() for f in (out.with_suffix(".eval.jsonl"), out))
    assert len(held) == 1 and len(train) == 23 and not set(held) & set(train)
    assert json.loads(out.with_suffix(".json").read_text())["eval_split_fraction"] == 0.05


def test_a_hub_id_reads_its_copy_when_there_is_one(tmp_path):
    data = tmp_path / "tiny" / "data"
    assert dataset.resolve("org/chat-set", data / "train.jsonl").kind == "hub"  # streamed as text
    copied = dataset.hub_copy(data, "org/chat-set")
    copied.parent.mkdir(parents=True)
    copied.write_text(json.dumps({"prompt": "2+2?", "completion": "4"}) + "\n")
    source = dataset.resolve("org/chat-set", data / "train.jsonl")
    assert (source.kind, source.file, source.format) == ("file", str(copied), "chat")


@pytest.mark.parametrize("columns,broken,said", [
    ("messages=dialogue", None, "has no column dialogue (it has "),
    ("message=conversations", None, "is not <ours>=<their column>"),
    ("messages=conversations", {"conversations": [{"role": "user", "content": "Hi"}]},
     "split 'train_sft':25 has no assistant message"),
])
def test_bad_columns_or_records_are_one_line_and_leave_nothing(chat_set, tmp_path, columns, broken, said):
    if broken is not None:
        with open(chat_set / "data" / "train_sft-00000-of-00001.jsonl", "a") as handle:
            handle.write(json.dumps({"id": 99, **broken}) + "\n")
    root = tmp_path / "ckpt"
    refused = copy(root, chat_set, "--split", "train_sft", "--columns", columns, check=False)
    # datasets' own progress bars come first; the refusal is one line, the last
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.returncode == 2 and len(errors) == 1 and said in errors[0], refused.stderr
    assert refused.stderr.strip().splitlines()[-1] == errors[0]
    assert not list((root / "tiny" / "data").glob("hub/*"))


def test_split_without_a_dataset_is_refused(tmp_path):
    refused = run_pipeline("data", "--model", "tiny", "--split", "train", root=tmp_path, check=False)
    assert refused.returncode == 2 and "DATASET=(unset) is not one" in refused.stderr


@pytest.mark.slow
def test_sft_on_a_copied_split_trains_with_eval_loss(chat_set, tiny_root):
    copy(tiny_root, chat_set, "--split", "train_sft", "--eval-split", "test_sft", "--columns", "messages=conversations")
    config = REPO / "configs" / "finetune" / "sft.toml"  # `make sft`'s settings: eval every 5 steps
    run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "5", "--dataset", str(chat_set),
                 "--config", str(config), "--name", "hub-sft", root=tiny_root)
    metrics = read_metrics(run_dir(tiny_root, "tiny", "hub-sft"))
    assert metrics[-1]["step"] == 5 and [m["step"] for m in metrics if "eval_loss" in m] == [1, 5], metrics
    spec = json.loads((run_dir(tiny_root, "tiny", "hub-sft") / "run.json").read_text())
    assert spec["data_format"] == "chat" and spec["data_file"].endswith("hub/ultrachat-like.jsonl")
    # an eval split none of whose conversations fits in seq_len: one line from the rank, not a hang
    long_set = hub_shaped(chat_set.parent / "long-eval", [conversation(i) for i in range(24)],
                          [conversation(150 + i) for i in range(4)])
    copy(tiny_root, long_set, "--split", "train_sft", "--eval-split", "test_sft", "--columns", "messages=conversations")
    failed = run_pipeline("train", "--model", "tiny", "--path", "native", "--steps", "2", "--dataset", str(long_set),
                          "--config", str(config), "--name", "long-eval", root=tiny_root, check=False, timeout=300)
    assert failed.returncode == 2 and "fits in seq_len 128" in failed.stderr and "long-eval.eval.jsonl" in failed.stderr, \
        failed.stderr[-2000:]


def local_set(directory: Path, rows: list[dict]) -> Path:
    directory.mkdir(parents=True)
    (directory / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return directory


@pytest.mark.parametrize("columns, expected, form", [
    # their own "text" column comes first: text=summary must still copy the summaries
    ("text=summary", {"text": "short 2"}, "text"),
    # a chat mapping: their text column is not copied beside it
    ("prompt=question,completion=answer", {"prompt": "q2?", "completion": "a2"}, "chat"),
])
def test_columns_are_applied_to_a_local_directory_and_recorded_as_applied(tmp_path, columns, expected, form):
    rows = [{"summary": f"short {i}", "text": f"full article {i}", "question": f"q{i}?", "answer": f"a{i}"}
            for i in range(5)]
    mine, root = local_set(tmp_path / "articles", rows), tmp_path / "ckpt"
    copy(root, mine, "--columns", columns, "--hold-out", "0")  # every record kept: line 3 is record 3
    out = root / "tiny" / "data" / "hub" / "articles.jsonl"
    assert json.loads(out.read_text().splitlines()[2]) == expected
    record = json.loads(out.with_suffix(".json").read_text())
    assert record["format"] == form and record["dataset"] == str(mine.resolve())
    assert record["columns"] == dict(item.split("=") for item in columns.split(","))
    source = dataset.resolve(str(mine), root / "tiny" / "data" / "train.jsonl")
    assert (source.file, source.format) == (str(out), form)


def test_an_ambiguous_or_foreign_copy_is_refused(tmp_path):
    both = local_set(tmp_path / "both", [{"text": "t", "messages": [{"role": "user", "content": "Hi"},
                                                                   {"role": "assistant", "content": "Hello"}]}])
    root = tmp_path / "ckpt"
    refused = copy(root, both, "--columns", "", "--split", "train", check=False)
    assert refused.returncode == 2 and "has a text column and chat columns" in refused.stderr
    mixed = copy(root, both, "--columns", "text=text,messages=messages", check=False)
    assert mixed.returncode == 2 and "maps both text and chat columns" in mixed.stderr
    assert not list((root / "tiny" / "data").glob("hub/*"))
    # a copy made of another directory with the same name is not this one's
    copy(root, both, "--columns", "text=text")
    other = local_set(tmp_path / "elsewhere" / "both", [{"text": "other"}])
    with pytest.raises(PipelineError, match=r"is a dataset directory and its copy .* is of .*/both"):
        dataset.resolve(str(other), root / "tiny" / "data" / "train.jsonl")
