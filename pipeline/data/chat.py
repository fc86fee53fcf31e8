"""Chat data: conversations tokenised with the checkpoint's own chat template, loss on assistant
tokens only, every turn.

A JSON-lines file is chat when its records hold `messages` (a list of {"role", "content"} with
roles system / user / assistant, any number of turns) or `prompt` / `completion` (a string each,
or lists of messages, as TRL's conversational prompt-completion datasets write them).

Each conversation is rendered once by the tokenizer's chat template and tokenised once; an
assistant turn's tokens run from the end of the rendered prefix with the generation prompt
(`<|im_start|>assistant\\n` for Qwen3) to the template's turn end (`<|im_end|>`), found by
rendering a probe conversation. Both boundaries are checked to tokenise as a prefix of the whole
conversation, so no BPE merge across a boundary can shift a mask. Labels elsewhere are
IGNORE_INDEX, which torchtitan's loss skips and its token count (global_valid_tokens) leaves out.

torchtitan 0.3.0's ChatDataset packs samples greedily with per-document positions (the models
build their block-causal masks from positions restarting at 0) but accepts one [user, assistant]
pair and masks only the first prompt; MultiTurnChatDataset keeps its packing, checkpointing and
re-looping and replaces the tokenisation. torchtitan main moved this to ChatProcessor (a
SampleProcessor with the same _tokenize_sample shape and the same single-turn limit) under the Grain
loader; MultiTurnChatProcessor replaces its tokenisation the same way. `tokenize_conversation` is the
part both use.
"""

from __future__ import annotations

from typing import Any

ROLES = ("system", "user", "assistant")
IGNORE_INDEX = -100  # torchtitan.components.loss.IGNORE_INDEX (the same value in 0.3.0 and main)
PROBE = [{"role": "user", "content": "\x01"}, {"role": "assistant", "content": "\x02"}]


def is_chat_record(record: dict) -> bool:
    return "messages" in record or ("prompt" in record and "completion" in record)


def to_messages(record: dict) -> list[dict[str, str]]:
    """A chat record as a list of messages (prompt/completion → user then assistant turns)."""
    if "messages" in record:
        return record["messages"]
    prompt, completion = record["prompt"], record["completion"]
    prompt = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    completion = [{"role": "assistant", "content": completion}] if isinstance(completion, str) else list(completion)
    return prompt + completion


def conversation_problem(record: Any) -> str | None:
    """Why a record is not a conversation this pipeline trains on, or None."""
    if not isinstance(record, dict) or not is_chat_record(record):
        return "has neither \"messages\" nor \"prompt\" and \"completion\""
    if "messages" not in record:
        for key in ("prompt", "completion"):
            if not isinstance(record[key], (str, list)):
                return f"\"{key}\" is a {type(record[key]).__name__}, not a string or a list of messages"
    messages = to_messages(record)
    if not isinstance(messages, list) or not messages:
        return "\"messages\" is not a non-empty list"
    for number, message in enumerate(messages, 1):
        if not isinstance(message, dict) or message.get("role") not in ROLES:
            return f"message {number} has no role among {', '.join(ROLES)}"
        if not isinstance(message.get("content"), str):
            return f"message {number} ({message['role']}) has no \"content\" string"
    if not any(m["role"] == "assistant" for m in messages):
        return "has no assistant message (nothing to train on)"
    if messages[0]["role"] == "assistant":
        return "starts with an assistant message (a conversation starts with system or user)"
    return None


def turn_end(tokenizer) -> str:
    """What the template writes after an assistant message's content (Qwen3: <|im_end|>)."""
    rendered = tokenizer.apply_chat_template(PROBE)
    after = rendered[rendered.rindex("\x02") + 1:].strip()
    if not after:
        raise ValueError("the chat template writes nothing after an assistant message: its turns cannot be told apart")
    return after


def tokenize_conversation(tokenizer, messages: list[dict[str, str]], max_len: int,
                          end: str | None = None) -> tuple[list[int], list[int]] | None:
    """(input_ids, labels) of one conversation: labels[t] is input t+1's token inside an assistant
    turn (its content and turn end), IGNORE_INDEX elsewhere. None when longer than `max_len`
    (dropped, as torchtitan's ChatDataset drops them, rather than training on a cut response)."""
    end = end or turn_end(tokenizer)
    text = tokenizer.apply_chat_template(messages).rstrip("\n")
    tokens = tokenizer.encode(text, add_bos=True, add_eos=False)
    if tokens[-1] != tokenizer.eos_id:
        tokens.append(tokenizer.eos_id)  # documents end with EOS, as torchtitan's packing expects
    if len(tokens) - 1 > max_len:
        return None
    trained = [False] * len(tokens)
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix = tokenizer.apply_chat_template(messages[:index], add_generation_prompt=True)
        if not text.startswith(prefix):
            raise ValueError(f"the chat template renders the conversation before assistant message {index + 1} "
                             "differently on its own: its turn cannot be located")
        content_at = text.find(message["content"], len(prefix)) if message["content"] else len(prefix)
        stop = text.find(end, max(content_at, len(prefix)) + len(message["content"]))
        stop = len(text) if stop < 0 else stop + len(end)
        first, last = _token_boundary(tokenizer, tokens, text, len(prefix)), _token_boundary(tokenizer, tokens, text, stop)
        for t in range(first, last):
            trained[t] = True
    labels = [token if trained[t + 1] else IGNORE_INDEX for t, token in enumerate(tokens[1:])]
    return tokens[:-1], labels


def _token_boundary(tokenizer, tokens: list[int], text: str, at: int) -> int:
    """How many of the conversation's tokens cover text[:at], checked to be an exact prefix."""
    head = tokenizer.encode(text[:at], add_bos=True, add_eos=False)
    if tokens[:len(head)] != head:
        raise ValueError(f"text before character {at} does not tokenise as a prefix of the conversation "
                         "(a BPE merge across a turn boundary)")
    return len(head)


# ---- rank side: multi-turn tokenisation in torchtitan's chat loaders (0.3.0 and main) ------------

def dataloader_config(data_file: str):
    """The Trainer.Config dataloader for a chat JSON-lines file: 0.3.0's ChatDataset, or on main's API
    the Grain loader packing conversations first-fit, each tokenised by MultiTurnChatProcessor."""
    from pipeline.titan import api

    if api.folded_batch():
        return api.chat_dataloader(data_file, _main_processor().Config(messages_fn=to_messages))
    return _classes()[1].Config(dataset_path="json", load_dataset_kwargs={"data_files": data_file, "split": "train"},
                                sample_processor=to_messages, infinite=True)


_MAIN_PROCESSOR = None


def _main_processor():
    """torchtitan main's ChatProcessor (single-turn: one [user, assistant] pair, that prompt masked) with
    tokenize_conversation in place of its tokenisation: any number of turns, every assistant turn
    trained, both boundaries of each checked. Made on first use: ranks only import torchtitan."""
    global _MAIN_PROCESSOR
    if _MAIN_PROCESSOR is not None:
        return _MAIN_PROCESSOR
    from dataclasses import dataclass

    import numpy as np
    from torchtitan.components.data.dataset import TextSequence
    from torchtitan.hf_datasets.text_datasets import ChatProcessor

    class MultiTurnChatProcessor(ChatProcessor):
        @dataclass(kw_only=True, slots=True)
        class Config(ChatProcessor.Config):
            pass

        def __init__(self, config, *, context):
            super().__init__(config, context=context)
            self._turn_end = turn_end(self._tokenizer)

        def _tokenize_sample(self, sample):
            messages = self._messages_fn(sample)
            problem = conversation_problem({"messages": messages})
            if problem:
                raise ValueError(f"chat sample {problem}")
            tokens = tokenize_conversation(self._tokenizer, messages, self._max_context_length, self._turn_end)
            if tokens is None:
                return None  # longer than max_context_length: dropped, as ChatProcessor drops it
            return TextSequence(input_ids=np.asarray(tokens[0], dtype=np.int64),
                                labels=np.asarray(tokens[1], dtype=np.int64))

    _MAIN_PROCESSOR = MultiTurnChatProcessor
    return _MAIN_PROCESSOR


_CLASSES: tuple | None = None


def _classes():
    """(MultiTurnChatDataset, ChatDataLoader) made on first use: torchtitan is imported in ranks only."""
    global _CLASSES
    if _CLASSES is not None:
        return _CLASSES
    from dataclasses import dataclass

    from datasets import load_dataset
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.hf_datasets import text_datasets

    class MultiTurnChatDataset(text_datasets.ChatDataset):
        """torchtitan's ChatDataset (greedy packing, positions, checkpointed state) with every
        assistant turn of a multi-turn conversation trained."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._turn_end = turn_end(self._tokenizer)
            self._dropped_in_a_row = 0

        def _tokenize_sample(self, sample):
            messages = self._sample_processor(sample)
            problem = conversation_problem({"messages": messages})
            if problem:
                raise ValueError(f"chat sample {self._sample_idx} {problem}")
            tokens = tokenize_conversation(self._tokenizer, messages, self.seq_len, self._turn_end)
            self._dropped_in_a_row = self._dropped_in_a_row + 1 if tokens is None else 0
            if self._dropped_in_a_row >= len(self._data):
                # torchtitan's loop would re-loop forever (training) or yield no batch (eval) without a word
                from pipeline.errors import PipelineError

                raise PipelineError(f"none of the {len(self._data)} conversations of this rank's share of "
                                    f"{getattr(self, 'origin', self._dataset_id)} fits in seq_len {self.seq_len} tokens (longer ones are "
                                    "dropped, never cut).", "raise SEQ_LEN, or give shorter conversations.")
            return tokens

    class ChatDataLoader(ParallelAwareDataloader):
        """torchtitan's ChatDataLoader with MultiTurnChatDataset in place of ChatDataset."""

        @dataclass(kw_only=True, slots=True)
        class Config(text_datasets.ChatDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size: int, dp_rank: int, tokenizer, seq_len: int,
                     local_batch_size: int, snapshot_every_n_steps: int | None = 1, **kwargs):
            if getattr(tokenizer, "_chat_template", None) is None:
                from pipeline.errors import PipelineError

                raise PipelineError("the checkpoint's tokenizer has no chat template (tokenizer_config.json "
                                    "chat_template or chat_template.jinja), so chat data cannot be rendered.",
                                    "train from an instruct checkpoint, or add the model family's chat template.")
            try:
                records = load_dataset(config.dataset_path, **config.load_dataset_kwargs)
            except Exception as err:  # datasets raises many kinds (DatasetGenerationError, FileNotFoundError, …)
                from pipeline.errors import PipelineError

                raise PipelineError(f"the ranks cannot open the chat data {config.load_dataset_kwargs.get('data_files')}: "
                                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                                    "check the data (FRESH=1 reads all of it before it starts a run).") from err
            dataset = MultiTurnChatDataset(
                dataset=records, tokenizer=tokenizer,
                sample_processor=config.sample_processor, seq_len=seq_len, dp_rank=dp_rank,
                dp_world_size=dp_world_size, infinite=config.infinite)
            dataset.origin = config.load_dataset_kwargs.get("data_files")
            super().__init__(dataset, dp_rank=dp_rank, dp_world_size=dp_world_size,
                             num_workers=config.num_workers, persistent_workers=config.persistent_workers,
                             pin_memory=config.pin_memory, prefetch_factor=config.prefetch_factor,
                             snapshot_every_n_steps=snapshot_every_n_steps, batch_size=local_batch_size)

    _CLASSES = (MultiTurnChatDataset, ChatDataLoader)
    return _CLASSES
