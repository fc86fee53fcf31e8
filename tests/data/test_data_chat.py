"""pipeline/data/chat.py: conversations rendered by the checkpoint's chat template with every
assistant turn trained and nothing else; chat files told by their keys; and a real SFT step whose
loss plain transformers reproduces over the assistant tokens alone, on hf, native and nki."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.data import chat, dataset
from helpers import dry_run_spec, run_pipeline

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is a tensor?"},
    {"role": "assistant", "content": "An array of numbers."},
    {"role": "user", "content": "And a scalar?"},
    {"role": "assistant", "content": "One number."},
]


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from pipeline.checkpoint.embedded import tokenizer_dir

    return HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir()))


def trained_spans(tokenizer, labels: list[int]) -> list[str]:
    """The label runs that are not IGNORE_INDEX, decoded with special tokens shown."""
    spans, run = [], []
    for label in labels + [chat.IGNORE_INDEX]:
        if label != chat.IGNORE_INDEX:
            run.append(label)
        elif run:
            spans.append(tokenizer.tokenizer.decode(run, skip_special_tokens=False))
            run = []
    return spans


def test_the_embedded_tokenizer_ships_qwen3s_chat_template():
    from pipeline.checkpoint.embedded import tokenizer_dir

    config = json.loads((tokenizer_dir() / "tokenizer_config.json").read_text())
    assert "<|im_start|>" in config["chat_template"] and config["eos_token"] == "<|im_end|>"


def test_every_assistant_turn_is_trained_and_nothing_else(tokenizer):
    inputs, labels = chat.tokenize_conversation(tokenizer, CONVERSATION, max_len=512)
    assert len(inputs) == len(labels)
    # Turn by turn: the first answer with its turn end; the last one as Qwen3's template writes a
    # final answer (an empty think block first); system and user text and the markup never.
    assert trained_spans(tokenizer, labels) == ["An array of numbers.<|im_end|>",
                                                "<think>\n\n</think>\n\nOne number.<|im_end|>"]
    # labels are the inputs shifted by one where trained
    full = inputs + [labels[-1]]
    assert all(label in (chat.IGNORE_INDEX, full[t + 1]) for t, label in enumerate(labels))
    # a third turn moves the second answer out of the last place: it is trained as written there
    longer = CONVERSATION + [{"role": "user", "content": "Thanks."}, {"role": "assistant", "content": "Welcome."}]
    _, labels = chat.tokenize_conversation(tokenizer, longer, max_len=512)
    assert trained_spans(tokenizer, labels) == ["An array of numbers.<|im_end|>", "One number.<|im_end|>",
                                                "<think>\n\n</think>\n\nWelcome.<|im_end|>"]


def test_prompt_completion_is_a_user_then_an_assistant_turn(tokenizer):
    record = {"prompt": "What is a tensor?", "completion": "An array of numbers."}
    assert chat.to_messages(record) == CONVERSATION[1:3]
    _, labels = chat.tokenize_conversation(tokenizer, chat.to_messages(record), max_len=512)
    assert trained_spans(tokenizer, labels) == ["<think>\n\n</think>\n\nAn array of numbers.<|im_end|>"]
    assert chat.tokenize_conversation(tokenizer, CONVERSATION, max_len=10) is None  # too long: dropped


def write_jsonl(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_a_chat_file_is_told_by_its_keys_and_checked_line_by_line(tmp_path):
    chat_file = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}, {"prompt": "a", "completion": "b"}])
    assert dataset.resolve(str(chat_file), tmp_path / "train.jsonl").format == "chat"
    text_file = write_jsonl(tmp_path / "text.jsonl", [{"text": "a document"}])
    assert dataset.resolve(str(text_file), tmp_path / "train.jsonl").format == "text"
    cases = {
        "mixed": ([{"messages": CONVERSATION}, {"text": "plain"}], 'has neither "messages" nor "prompt"'),
        "role": ([{"messages": [{"role": "user", "content": "q"}, {"role": "bot", "content": "a"}]}],
                 "message 2 has no role among system, user, assistant"),
        "no-answer": ([{"messages": [{"role": "user", "content": "q"}]}], "has no assistant message"),
    }
    for name, (records, expected) in cases.items():
        path = write_jsonl(tmp_path / f"{name}.jsonl", records)
        with pytest.raises(PipelineError, match=expected):
            dataset.resolve(str(path), tmp_path / "train.jsonl")


def test_the_data_stage_splits_its_chat_set_without_overlap(tmp_path):
    from pipeline.data import data_files as data

    train, held, n_train, n_held = data.write_chat_data(tmp_path / "train.jsonl")
    rows = [line for line in train.read_text().splitlines()]
    held_rows = [line for line in held.read_text().splitlines()]
    assert len(rows) == n_train > 300 and len(held_rows) == n_held > 40
    assert not set(rows) & set(held_rows)
    assert data.write_chat_data(tmp_path / "again" / "train.jsonl")[0].read_text() == train.read_text()  # deterministic


# ---- a real SFT step on every path --------------------------------------------------------------

@pytest.fixture(scope="module")
def sft_runs(checkpoints, tmp_path_factory):
    """One chat step of tiny on each path (one rank), from a two-conversation multi-turn file."""
    from helpers import copy_model
    from helpers import cli
    from tiny_checkpoint import ok

    base = tmp_path_factory.mktemp("sft")
    root = copy_model(checkpoints, base / "root", link=True)
    conversations = [CONVERSATION, [{"role": "user", "content": "Name a framework."},
                                    {"role": "assistant", "content": "torchtitan, for training at scale."}]]
    data = write_jsonl(base / "conversations.jsonl", [{"messages": c} for c in conversations])
    runs = {}
    for path in ("native", "hf", "nki"):
        ok(cli("train", "--model", "tiny", "--path", path, "--dataset", str(data), "--steps", "1",
                        "--nproc-per-node", "1", "--name", f"sft-{path}", root=root))
        runs[path] = root / "tiny" / "runs" / f"sft-{path}"
    return root, conversations, runs


def test_step1_loss_is_plain_transformers_loss_over_the_assistant_tokens(sft_runs):
    import torch
    import torch.nn.functional as F
    import transformers
    from safetensors.torch import load_file

    root, conversations, runs = sft_runs
    source = root / "tiny" / "source"
    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(source))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32).eval()
    batch = load_file(str(runs["native"] / "first_batch" / "rank0.safetensors"))
    batch = {k: v.unsqueeze(0) if v.dim() == 1 else v for k, v in batch.items()}  # main records one [T] row
    assert json.loads((runs["native"] / "run.json").read_text())["data_format"] == "chat"
    # Every conversation's rendering, by transformers' own tokenizer, and its assistant text.
    rendered = {}  # the inputs of each conversation (its tokens but the last) → the conversation
    for c in conversations:
        text = hf_tokenizer.apply_chat_template(c, tokenize=False).rstrip("\n")
        rendered[tuple(hf_tokenizer(text, add_special_tokens=False)["input_ids"][:-1])] = c
    total, count, unmasked_total, unmasked_count, seen = 0.0, 0, 0.0, 0, set()
    with torch.no_grad():
        for row in range(batch["input"].shape[0]):
            positions = batch["positions"][row]
            starts = (positions == 0).nonzero().flatten().tolist() + [positions.numel()]
            for start, end in zip(starts, starts[1:]):
                ids, labels = batch["input"][row, start:end], batch["labels"][row, start:end]
                text = tuple(ids.tolist())
                if text not in rendered:
                    assert (labels == -100).all()  # the padding after the last document
                    continue
                seen.add(text)
                trained = hf_tokenizer.decode(labels[labels != -100].tolist())
                answers = [m["content"] for m in rendered[text] if m["role"] == "assistant"]
                # the trained tokens are the answers with their turn ends, nothing of the prompts
                assert trained.replace("<think>\n\n</think>\n\n", "") == "".join(a + "<|im_end|>" for a in answers)
                logits = model(input_ids=ids.unsqueeze(0)).logits[0]
                keep = labels != -100
                total += F.cross_entropy(logits[keep], labels[keep], reduction="sum").item()
                count += int(keep.sum())
                full = ids[1:]  # what an unmasked loss would score
                unmasked_total += F.cross_entropy(logits[:-1], full, reduction="sum").item()
                unmasked_count += full.numel()
    assert seen == set(rendered)  # both conversations are in the recorded batch
    logged = json.loads((runs["native"] / "metrics.jsonl").read_text().splitlines()[0])["loss"]
    assert abs(total / count - logged) < 1e-4, (total / count, logged)
    assert abs(unmasked_total / unmasked_count - logged) > 0.05  # the masked positions would have changed it
    for path in ("hf", "nki"):  # the same data and masks on the other paths: the same step-1 loss
        other = json.loads((runs[path] / "metrics.jsonl").read_text().splitlines()[0])["loss"]
        assert abs(other - logged) < 1e-4, (path, other, logged)


def test_chat_resolves_on_the_installed_torchtitan_api(tmp_path):
    """Both tiers run this: chat data is a supported run on 0.3.0 and on main's API (the dry run resolves)."""
    result = run_pipeline("train", "--model", "tiny", "--path", "native", "--dataset", "chat", "--dry-run",
                          root=tmp_path, check=False)
    assert result.returncode == 0, result.stderr[-1500:]
    assert dry_run_spec(result.stdout)["data_format"] == "chat"
