"""pipeline/data/preference.py and pipeline/titan/dpo.py's loss: TRL's preference formats, the completion
tokens alone labelled (TRL 1.16's tokenisation, computed here with transformers' own chat template), equal pairs
refused, the DPO losses as TRL defines them, the memory estimate's reference model."""

from __future__ import annotations

import json
import math

import pytest

from pipeline.errors import PipelineError
from pipeline.data import dataset, preference

PROMPT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is a tensor?"}]
CHOSEN = [{"role": "assistant", "content": "An array of numbers."}]
REJECTED = [{"role": "assistant", "content": "A kind of fish."}]


@pytest.fixture(scope="module")
def tokenizer():
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from pipeline.checkpoint.embedded import tokenizer_dir

    return HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir()))


def test_the_formats_trl_reads_are_preference_pairs():
    explicit = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": REJECTED}
    strings = {"prompt": "What is a tensor?", "chosen": "An array.", "rejected": "A fish."}
    implicit = {"chosen": PROMPT + CHOSEN, "rejected": PROMPT + REJECTED}
    for record in (explicit, strings, implicit):
        assert preference.pair_problem(record) is None, record
    assert preference.split_pair(implicit) == (PROMPT, CHOSEN, REJECTED)  # the shared messages are the prompt
    assert preference.split_pair(strings) == ([{"role": "user", "content": "What is a tensor?"}],
                                              [{"role": "assistant", "content": "An array."}],
                                              [{"role": "assistant", "content": "A fish."}])


@pytest.mark.parametrize("record, says", [
    ({"prompt": "q", "chosen": "same", "rejected": "same"}, "equal"),
    ({"chosen": PROMPT + CHOSEN, "rejected": PROMPT + CHOSEN}, "equal"),
    ({"prompt": "q", "chosen": 3, "rejected": "a"}, "not a string"),
    ({"chosen": "a", "rejected": "b"}, "no \"prompt\""),
    ({"prompt": PROMPT, "chosen": [{"role": "user", "content": "x"}], "rejected": REJECTED}, "non-assistant"),
    ({"prompt": "q", "chosen": []}, "no \"chosen\" and \"rejected\""),
])
def test_a_pair_that_is_no_preference_is_named(record, says):
    assert says in preference.pair_problem(record)


def test_a_preference_file_is_told_by_its_keys_and_an_equal_pair_refused_anywhere(tmp_path):
    good = {"prompt": "q", "chosen": "a", "rejected": "b"}
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(json.dumps(good) + "\n" for _ in range(9)) + json.dumps({**good, "rejected": "a"}) + "\n")
    # The first record tells the format; every line is read before launch, the 10th too.
    with pytest.raises(PipelineError, match=r"pairs.jsonl:10 has equal \"chosen\" and \"rejected\""):
        dataset.check_file(path)
    with pytest.raises(PipelineError, match=r"pairs.jsonl:10 has equal \"chosen\" and \"rejected\""):
        dataset.check_readable(dataset.DataSource("file", str(path), str(path), "preference"))
    path.write_text("".join(json.dumps(good) + "\n" for _ in range(10)))
    assert dataset.check_file(path) == "preference"


def test_only_the_completion_is_labelled_as_trl_tokenises_it(tokenizer):
    """The labelled tokens are exactly TRL 1.16's completion: prompt + completion rendered by transformers' chat
    template, minus the prompt rendered with the generation prompt (trl/trainer/dpo_trainer.py, tokenize_fn)."""
    from transformers import AutoTokenizer

    from pipeline.checkpoint.embedded import tokenizer_dir

    hf = AutoTokenizer.from_pretrained(str(tokenizer_dir()))
    for completion in (CHOSEN, REJECTED):
        ids, labels = preference.tokenize_completion(tokenizer, PROMPT, completion, max_len=512)
        prompt_ids = hf.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        full = hf.apply_chat_template(PROMPT + completion, tokenize=True, return_dict=True)["input_ids"]
        assert ids + [labels[-1]] == full
        trained = [label for label in labels if label != preference.IGNORE_INDEX]
        assert trained == full[len(prompt_ids):]
        assert labels[:len(prompt_ids) - 1] == [preference.IGNORE_INDEX] * (len(prompt_ids) - 1)  # no prompt token
        assert hf.decode(trained) == f"<think>\n\n</think>\n\n{completion[0]['content']}<|im_end|>\n"


def test_a_pair_longer_than_seq_len_is_dropped_not_cut(tokenizer):
    record = {"prompt": PROMPT, "chosen": CHOSEN, "rejected": [{"role": "assistant", "content": "word " * 200}]}
    assert preference.tokenize_pair(tokenizer, record, max_len=64) is None
    assert preference.tokenize_pair(tokenizer, record, max_len=512) is not None


def test_collate_puts_the_chosen_rows_first_then_the_rejected():
    import torch

    samples = [({"input": torch.tensor([[i, i], [10 + i, 10 + i]])}, torch.tensor([[i, i], [10 + i, 10 + i]]))
               for i in range(3)]
    inputs, labels = preference.collate(samples)
    assert inputs["input"][:, 0].tolist() == [0, 1, 2, 10, 11, 12] == labels[:, 0].tolist()


def test_folded_rows_give_each_row_s_log_probability_as_unfolded_ones():
    """main's batch (fold: the rows end to end, positions restarting) scores each row as 0.3.0's [rows, L] does."""
    import torch

    from pipeline.titan import dpo

    row_len, rows, vocab = 5, 4, 11
    samples = [({"input": torch.arange(2 * row_len).view(2, row_len) + 20 * i,
                 "positions": torch.arange(row_len).expand(2, -1)},
                torch.tensor([[-100, -100, 3, 4, 5], [-100, 6, 7, -100, -100]])) for i in range(rows // 2)]
    inputs, labels = preference.collate(samples)
    folded_inputs, folded_labels = preference.fold((inputs, labels))
    assert folded_inputs["input"].shape == (rows * row_len,) and folded_labels.shape == (rows * row_len,)
    assert folded_inputs["positions"].tolist() == list(range(row_len)) * rows  # each row's own positions from 0
    logits = torch.randn(rows, row_len, vocab)
    unfolded = dpo.sequence_logps(logits, labels, row_len, vocab)
    folded = dpo.sequence_logps(logits.view(rows * row_len, vocab), folded_labels, row_len, vocab)
    expected = torch.stack([torch.log_softmax(logits[r], -1)[labels[r] != -100].gather(
        -1, labels[r][labels[r] != -100].unsqueeze(-1)).sum() for r in range(rows)])
    assert torch.allclose(unfolded[0], expected) and torch.allclose(folded[0], expected)
    assert unfolded[1].tolist() == folded[1].tolist() == [3] * (rows // 2) + [2] * (rows // 2)  # chosen rows first


def test_dpo_losses_are_trls():
    import torch
    import torch.nn.functional as F

    from pipeline.titan import dpo

    ref = torch.tensor([-10.0, -12.0, -11.0, -9.0])  # rows: chosen 1, chosen 2, rejected 1, rejected 2
    logps = ref + torch.tensor([0.5, -0.2, -0.3, 0.4])
    tokens = torch.tensor([5, 4, 6, 3])
    same, _, _ = dpo.dpo_losses(ref, ref, tokens, 0.1, "sigmoid")
    assert torch.allclose(same, torch.full((2,), math.log(2)))  # policy = reference: ln 2 for every pair
    delta = torch.tensor([0.5 + 0.3, -0.2 - 0.4])
    sigmoid, chosen, rejected = dpo.dpo_losses(logps, ref, tokens, 0.1, "sigmoid")
    assert torch.allclose(sigmoid, -F.logsigmoid(0.1 * delta))
    assert torch.allclose(chosen, torch.tensor([0.5, -0.2])) and torch.allclose(rejected, torch.tensor([-0.3, 0.4]))
    hinge, _, _ = dpo.dpo_losses(logps, ref, tokens, 0.1, "hinge")
    assert torch.allclose(hinge, torch.relu(1 - 0.1 * delta))
    ipo, _, _ = dpo.dpo_losses(logps, ref, tokens, 0.1, "ipo")
    per_token = torch.tensor([0.5 / 5 + 0.3 / 6, -0.2 / 4 - 0.4 / 3])
    assert torch.allclose(ipo, (per_token - 1 / 0.2) ** 2)
    _, sums = dpo.pair_sums(logps, ref, tokens, 0.1, "sigmoid")
    metrics = dpo.means(sums)
    assert metrics["rewards/accuracies"] == 0.5 and math.isclose(metrics["rewards/margins"], 0.1 * delta.mean().item(),
                                                                 rel_tol=1e-5)
    assert math.isclose(metrics["completion_loss"], -logps.sum().item() / tokens.sum().item(), rel_tol=1e-5)


def test_the_memory_estimate_counts_the_reference_model():
    from pipeline.checkpoint.arch import arch_from_config
    from pipeline.checkpoint.embedded import EMBEDDED
    from pipeline.run.settings import TrainSettings
    from pipeline.training import memory

    arch = arch_from_config(EMBEDDED["tiny"].config, "tiny")
    settings = TrainSettings()
    sft, dpo = (memory.estimate(arch, settings, "native", "cpu", dpo=d) for d in (False, True))
    assert dpo.parts["reference model"] == sft.parts["parameters"]  # one float32 copy of the rank's shards
    assert dpo.parts["logits"] == 2 * sft.parts["logits"]  # every pair is two rows
    lora = memory.estimate(arch, TrainSettings(lora_rank=8), "native", "cpu", dpo=True)
    assert "reference model" not in lora.parts  # the base with its adapters off: no copy
