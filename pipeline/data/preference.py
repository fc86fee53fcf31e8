"""Preference pairs for DPO: TRL's preference formats, tokenised with the checkpoint's chat template,
the log-probabilities taken over each completion's tokens only.

A JSON-lines file is preference data when its records hold `chosen` and `rejected` (TRL's
preference type, https://huggingface.co/docs/trl/dataset_formats#preference): with an explicit
`prompt` (a string, or a list of messages), or without one, when `chosen` and `rejected` are whole
conversations sharing their first messages (TRL's implicit prompt: the shared messages are the
prompt). A string prompt is a user turn and a string completion an assistant turn, as for SFT's
prompt/completion (pipeline.data.chat), so every pair is rendered by the chat template; TRL
renders only conversational pairs so and concatenates plain strings.

Tokenisation is TRL 1.16 DPOTrainer's for conversational data: the prompt is rendered with the
generation prompt, prompt + completion rendered whole, and the completion is every token after the
prompt's (`<think>` block of Qwen3's template, content, `<|im_end|>` and the newline after it); the
prompt is checked to tokenise as an exact prefix (no BPE merge across it). A pair whose chosen and
rejected are equal teaches nothing (its loss is ln 2 whatever the model) and is refused before launch.

Each pair is one row for `chosen` and one for `rejected`, padded to seq_len (labels IGNORE_INDEX on
the prompt and the padding, positions 0… per row): a local batch of B pairs is 2B rows, the B chosen
rows first (TRL's [chosen, rejected] concatenation). A pair longer than seq_len is dropped, never cut. On
torchtitan main, whose batch is one row of tokens (#4121), the same rows are laid end to end (`fold`).
"""

from __future__ import annotations

from typing import Any

from pipeline.data.chat import IGNORE_INDEX, ROLES, _token_boundary


def is_preference_record(record: dict) -> bool:
    return "chosen" in record and "rejected" in record


def _as_messages(value, role: str) -> list:
    return [{"role": role, "content": value}] if isinstance(value, str) else list(value)


def split_pair(record: dict) -> tuple[list, list, list]:
    """(prompt, chosen, rejected) as lists of messages."""
    if "prompt" in record:
        return (_as_messages(record["prompt"], "user"), _as_messages(record["chosen"], "assistant"),
                _as_messages(record["rejected"], "assistant"))
    chosen, rejected = list(record["chosen"]), list(record["rejected"])
    shared = 0
    while shared < min(len(chosen), len(rejected)) - 1 and chosen[shared] == rejected[shared]:
        shared += 1
    return chosen[:shared], chosen[shared:], rejected[shared:]


def _messages_problem(messages: Any, what: str, completion: bool) -> str | None:
    if not isinstance(messages, list) or not messages:
        return f"{what} is not a non-empty list of messages"
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"{what} message {number} has no role among {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"{what} message {number} ({message['role']}) has no \"content\" string"
    if completion and any(m["role"] != "assistant" for m in messages):
        return f"{what} holds a non-assistant message (a completion is the assistant's answer)"
    if not completion and messages[0]["role"] == "assistant":
        return f"{what} starts with an assistant message (a conversation starts with system or user)"
    return None


def pair_problem(record: Any) -> str | None:
    """Why a record is not a preference pair this pipeline trains on, or None."""
    if not isinstance(record, dict) or not is_preference_record(record):
        return "has no \"chosen\" and \"rejected\""
    for key in ("prompt", "chosen", "rejected"):
        if key in record and not isinstance(record[key], (str, list)):
            return f"\"{key}\" is a {type(record[key]).__name__}, not a string or a list of messages"
    if "prompt" not in record and not (isinstance(record["chosen"], list) and isinstance(record["rejected"], list)):
        return "has no \"prompt\" (an implicit prompt needs \"chosen\" and \"rejected\" as lists of messages)"
    for key in ("chosen", "rejected"):
        if isinstance(record[key], list) and not record[key]:
            return f"\"{key}\" is an empty list"
    prompt, chosen, rejected = split_pair(record)
    for messages, what, completion in ((prompt, "prompt", False), (chosen, "chosen", True),
                                       (rejected, "rejected", True)):
        problem = _messages_problem(messages, what, completion)
        if problem:
            return problem
    if chosen == rejected:
        return "has equal \"chosen\" and \"rejected\" (no preference: its loss is ln 2 whatever the model)"
    return None


def tokenize_completion(tokenizer, prompt: list, completion: list, max_len: int) -> tuple[list[int], list[int]] | None:
    """(input_ids, labels) of prompt + completion: labels[t] is token t+1 where that token is the
    completion's, IGNORE_INDEX elsewhere. None when longer than max_len + 1 tokens."""
    head = tokenizer.apply_chat_template(prompt, add_generation_prompt=True)
    text = tokenizer.apply_chat_template(prompt + completion)
    if not text.startswith(head):
        raise ValueError("the chat template renders the prompt differently on its own: its completion cannot be located")
    tokens = tokenizer.encode(text, add_bos=True, add_eos=False)
    if len(tokens) - 1 > max_len:
        return None
    first = _token_boundary(tokenizer, tokens, text, len(head))
    if first >= len(tokens):
        raise ValueError("the completion renders to no tokens")
    labels = [token if t + 1 >= first else IGNORE_INDEX for t, token in enumerate(tokens[1:])]
    return tokens[:-1], labels


def tokenize_pair(tokenizer, record: dict, max_len: int):
    """((chosen ids, labels), (rejected ids, labels)), or None when either is longer than max_len."""
    prompt, chosen, rejected = split_pair(record)
    sides = tuple(tokenize_completion(tokenizer, prompt, completion, max_len) for completion in (chosen, rejected))
    return None if None in sides else sides


# ---- rank side: torchtitan's dataloader over preference pairs (either API) -------------------------

def dataloader_config(data_file: str, infinite: bool = True):
    from pipeline.titan import api

    load = {"dataset_path": "json", "load_dataset_kwargs": {"data_files": data_file, "split": "train"}}
    # torchtitan's Validator switches the loader to one pass with dataclasses.replace: 0.3.0 by `infinite`, main by `repeat`
    return _classes()[1].Config(**load, **({"repeat": infinite} if api.folded_batch() else {"infinite": infinite}))


def collate(samples):
    """[(({"input", "positions"}: [2, L]), labels [2, L])] → rows [2B, L]: the B chosen rows, then the B rejected."""
    import torch

    def rows(tensors):
        stacked = torch.stack(tensors)  # [B, 2, L]
        return torch.cat([stacked[:, 0], stacked[:, 1]])

    inputs = {key: rows([s[0][key] for s in samples]) for key in samples[0][0]}
    return inputs, rows([s[1] for s in samples])


def fold(batch):
    """collate()'s rows laid end to end, as main's folded batch ([T] tokens, #4121): each row keeps its positions
    0…L−1, so attention stays within it (as for packed documents) and DPO reads row r at tokens [r·L, (r+1)·L)."""
    inputs, labels = batch
    return {key: value.flatten() for key, value in inputs.items()}, labels.flatten()


_CLASSES: tuple | None = None


def _classes():
    """(PreferenceDataset, PreferenceDataLoader), made on first use: torchtitan is imported in ranks only."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from dataclasses import dataclass, field

    import torch
    from datasets import load_dataset
    from datasets.distributed import split_dataset_by_node
    from torch.distributed.checkpoint.stateful import Stateful
    from torch.utils.data import IterableDataset

    from pipeline.errors import PipelineError
    from pipeline.titan import api

    class PreferenceDataset(IterableDataset, Stateful):
        """One pair per sample, in the order torchtitan's ChatDataset reads conversations (shuffled with
        seed 42, split by data-parallel rank, re-shuffled each epoch), its position checkpointed."""

        def __init__(self, records, tokenizer, seq_len: int, dp_rank: int, dp_world_size: int, infinite: bool,
                     origin: str):
            self._original = split_dataset_by_node(records.shuffle(seed=42), dp_rank, dp_world_size)
            self._data = self._original
            self._tokenizer, self.seq_len, self.infinite, self.origin = tokenizer, seq_len, infinite, origin
            self._pad = tokenizer.eos_id
            self._sample_idx, self._epoch = 0, 0

        def _row(self, ids: list[int], labels: list[int]):
            pad = self.seq_len - len(ids)
            return ids + [self._pad] * pad, labels + [IGNORE_INDEX] * pad

        def __iter__(self):
            dropped_in_a_row = 0
            while True:
                for record in self._data.skip(self._sample_idx):
                    self._sample_idx += 1
                    problem = pair_problem(record)
                    if problem:
                        raise PipelineError(f"{self.origin}: a pair {problem}.", "fix the data (FRESH=1 reads all of it "
                                            "before it starts a run).")
                    sides = tokenize_pair(self._tokenizer, record, self.seq_len)
                    if sides is None:
                        dropped_in_a_row += 1
                        if dropped_in_a_row >= len(self._data):
                            raise PipelineError(f"none of the {len(self._data)} pairs of this rank's share of {self.origin} "
                                                f"fits in seq_len {self.seq_len} tokens (longer ones are dropped, never cut).",
                                                "raise SEQ_LEN, or give shorter pairs.")
                        continue
                    dropped_in_a_row = 0
                    rows = [self._row(*side) for side in sides]
                    ids = torch.tensor([r[0] for r in rows], dtype=torch.long)
                    positions = torch.arange(self.seq_len, dtype=torch.long).expand(2, -1).contiguous()
                    yield {"input": ids, "positions": positions}, torch.tensor([r[1] for r in rows], dtype=torch.long)
                if not self.infinite:
                    return
                self._sample_idx, self._epoch = 0, self._epoch + 1
                self._data = self._original.shuffle(seed=42 + self._epoch)

        def state_dict(self):
            return {"sample_idx": self._sample_idx, "epoch": self._epoch}

        def load_state_dict(self, state_dict):
            self._sample_idx, self._epoch = state_dict["sample_idx"], state_dict["epoch"]
            self._data = self._original.shuffle(seed=42 + self._epoch) if self._epoch else self._original

    def open_pairs(config, tokenizer, seq_len: int, dp_rank: int, dp_world_size: int, infinite: bool):
        if getattr(tokenizer, "_chat_template", None) is None:
            raise PipelineError("the checkpoint's tokenizer has no chat template, so preference pairs cannot be "
                                "rendered.", "train from an instruct checkpoint, or add the model family's chat template.")
        origin = config.load_dataset_kwargs.get("data_files")
        try:
            records = load_dataset(config.dataset_path, **config.load_dataset_kwargs)
        except Exception as err:  # datasets raises many kinds
            raise PipelineError(f"the ranks cannot open the preference data {origin}: {type(err).__name__}: "
                                f"{str(err).splitlines()[0] if str(err) else ''}",
                                "check the data (FRESH=1 reads all of it before it starts a run).") from err
        return PreferenceDataset(records, tokenizer, seq_len, dp_rank, dp_world_size, infinite, origin)

    if not api.folded_batch():
        from torchtitan.components.dataloader import ParallelAwareDataloader

        class PreferenceDataLoader(ParallelAwareDataloader):
            """0.3.0: batches of local_batch_size pairs, rows [2B, seq_len]."""

            @dataclass(kw_only=True, slots=True)
            class Config(ParallelAwareDataloader.Config):
                dataset_path: str = "json"
                load_dataset_kwargs: dict = field(default_factory=dict)
                infinite: bool = True

            def __init__(self, config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                         local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
                dataset = open_pairs(config, tokenizer, seq_len, dp_rank, dp_world_size, config.infinite)
                super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size, num_workers=config.num_workers,
                                 persistent_workers=config.persistent_workers, pin_memory=config.pin_memory,
                                 prefetch_factor=config.prefetch_factor, snapshot_every_n_steps=snapshot_every_n_steps,
                                 batch_size=local_batch_size, collate_fn=collate)
    else:
        from torchtitan.components.data.loader import BaseDataLoader

        class PreferenceDataLoader(BaseDataLoader):
            """main: the same batches of pairs folded (fold()), num_tokens_per_batch / max_context_length pairs each
            (what api.training_config makes of local_batch_size); its state is the dataset's position, per
            data-parallel rank as 0.3.0's loader keeps it."""

            @dataclass(kw_only=True, slots=True)
            class Config(BaseDataLoader.Config):
                dataset_path: str = "json"
                load_dataset_kwargs: dict = field(default_factory=dict)
                repeat: bool = True

            def __init__(self, config, *, dp_world_size: int, dp_rank: int, tokenizer, max_context_length: int,
                         num_tokens_per_batch: int, **kwargs):
                self.dataset = open_pairs(config, tokenizer, max_context_length, dp_rank, dp_world_size, config.repeat)
                self.pairs_per_batch = max(num_tokens_per_batch // max_context_length, 1)
                self._rank_id = f"dp_rank_{dp_rank}"

            def __iter__(self):
                samples = []
                for sample in self.dataset:
                    samples.append(sample)
                    if len(samples) == self.pairs_per_batch:
                        yield fold(collate(samples))
                        samples = []
                if samples:  # one pass (validation): the last pairs too, as 0.3.0's loader yields them
                    yield fold(collate(samples))

            def state_dict(self):
                return {self._rank_id: self.dataset.state_dict()}

            def load_state_dict(self, state_dict):
                if state_dict and self._rank_id in state_dict:
                    self.dataset.load_state_dict(state_dict[self._rank_id])

    _CLASSES = (PreferenceDataset, PreferenceDataLoader)
    return _CLASSES
