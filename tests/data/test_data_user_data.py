"""pipeline/data/user_data.py and stage `data` on a user's file or folder: read whole with the ranks' reader,
counted in tokens against SEQ_LEN, a deterministic held-out split written when the data has none, a run that
would evaluate nothing saying so once before launch; Hub datasets by subset and revision, recorded."""

from __future__ import annotations

import json
from pathlib import Path

from helpers import dry_run_spec, run_pipeline

LONG = 200  # words: far past the embedded configs' SEQ_LEN 128


def my_chats(directory: Path, count: int = 20, long: tuple[int, ...] = (7,)) -> Path:
    path = directory / "my_chats.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Say {i}."},
                          {"role": "assistant", "content": " ".join(["word"] * (LONG if i in long else 5))}]}
            for i in range(count)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def sft_dry_run(root: Path, data: Path):
    return run_pipeline("train", "--model", "tiny", "--path", "native", "--dataset", str(data), "--dry-run",
                        "--config", "configs/finetune/sft.toml", root=root)


def test_a_users_chat_file_is_counted_and_split_and_the_run_evaluates_on_the_split(tmp_path):
    root, data = tmp_path / "ckpt", my_chats(tmp_path)
    done = run_pipeline("data", "--model", "tiny", "--dataset", str(data), root=root)
    assert f"DATASET={data}: 20 conversations, " in done.stdout
    assert "19 fit SEQ_LEN 128, 1 longer, dropped" in done.stdout
    (split,) = (root / "data" / "sets").iterdir()
    train, held = (split / "train.jsonl").read_text(), (split / "eval.jsonl").read_text()
    assert len(held.splitlines()) == 1 and len(train.splitlines()) == 19  # 5 % of 20, at least one
    assert sorted(train.splitlines() + held.splitlines()) == sorted(data.read_text().splitlines())
    record = json.loads((split / "source.json").read_text())
    assert record["eval_split"] == 0.05 and record["file"] == str(data.resolve())
    # deterministic: the same file splits the same way, whatever its order
    lines = data.read_text().splitlines()
    data.write_text("\n".join(reversed(lines)) + "\n")
    run_pipeline("data", "--model", "tiny", "--dataset", str(data), root=root)
    resplit = [p for p in (root / "data" / "sets").iterdir() if p != split]
    assert [json.loads(line) for line in (resplit[0] / "eval.jsonl").read_text().splitlines()] == \
        [json.loads(line) for line in held.splitlines()]
    spec = dry_run_spec(sft_dry_run(root, data).stdout)
    assert spec["data_file"] == str(resplit[0] / "train.jsonl") and spec["eval_file"] == str(resplit[0] / "eval.jsonl")


def test_eval_split_zero_and_text_data_write_no_split_and_the_run_says_it_evaluates_nothing(tmp_path):
    root, data = tmp_path / "ckpt", my_chats(tmp_path)
    run_pipeline("data", "--model", "tiny", "--dataset", str(data), "--hold-out", "0", root=root)
    assert not (root / "data" / "sets").exists()
    dry = sft_dry_run(root, data)
    notes = [line for line in dry.stderr.splitlines() if "nothing will be evaluated" in line]
    assert len(notes) == 1 and f"make data DATASET={data}" in notes[0], dry.stderr
    assert dry_run_spec(dry.stdout)["eval_file"] is None
    text = tmp_path / "notes.jsonl"
    text.write_text("".join(json.dumps({"text": f"document {i} " * (i + 1)}) + "\n" for i in range(4)))
    done = run_pipeline("data", "--model", "tiny", "--dataset", str(text), "--seq-len", "8", root=root)
    assert "4 documents, " in done.stdout and "2 fit SEQ_LEN 8, 2 longer, packed across windows" in done.stdout
    assert not (root / "data" / "sets").exists()
    bad = run_pipeline("data", "--model", "tiny", "--dataset", str(data), "--hold-out", "1.5", root=root, check=False)
    assert bad.returncode == 2 and "EVAL_SPLIT=1.5 is not a fraction" in bad.stderr


def test_a_hub_shaped_folder_takes_a_subset_and_revision_recorded_with_the_copy(tmp_path):
    folder = tmp_path / "sets"
    for subset in ("small", "big"):
        (folder / subset).mkdir(parents=True)
        (folder / subset / "train.jsonl").write_text(json.dumps({"text": f"the {subset} one"}) + "\n")
    (folder / "README.md").write_text("---\nconfigs:\n" + "".join(
        f"- config_name: {s}\n  data_files:\n  - split: train\n    path: {s}/train.jsonl\n" for s in ("small", "big"))
        + "---\n")
    root = tmp_path / "ckpt"
    run_pipeline("data", "--model", "tiny", "--dataset", str(folder), "--subset", "big", "--dataset-revision", "v1",
                 root=root)
    copy = root / "tiny" / "data" / "hub" / "sets.jsonl"
    assert copy.read_text() == json.dumps({"text": "the big one"}) + "\n"
    record = json.loads(copy.with_suffix(".json").read_text())
    assert (record["subset"], record["revision"]) == ("big", "v1")


def test_preference_pairs_are_counted_and_a_config_naming_its_eval_data_keeps_them_whole(tmp_path):
    root = tmp_path / "ckpt"
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"prompt": f"Say {i}.", "chosen": "yes " * 3, "rejected": "no"}) + "\n"
                             for i in range(20)))
    done = run_pipeline("data", "--model", "tiny", "--dataset", str(pairs), root=root)
    assert f"DATASET={pairs}: 20 preference pairs, " in done.stdout and "20 fit SEQ_LEN 128" in done.stdout
    (split,) = (root / "data" / "sets").iterdir()
    assert len((split / "eval.jsonl").read_text().splitlines()) == 1  # held out like chat data: 5 %, at least one
    config = tmp_path / "dpo.toml"
    config.write_text(f'[train]\neval_dataset = "{pairs}"\n')
    again = tmp_path / "again"
    done = run_pipeline("data", "--model", "tiny", "--dataset", str(pairs), "--config", str(config), root=again)
    assert "held out for eval" not in done.stdout and not (again / "data" / "sets").exists()
