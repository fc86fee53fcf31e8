"""TRL's side of `make bench`'s peers section: TRL 1.16's SFTTrainer (or DPOTrainer) on what a pipeline run
trained on — its source weights (float32), its train split (run.json's data_file), seq_len, batch, lr, warm-up,
AdamW betas/eps, no weight decay, gradient clipping — with this process's threads (run.py gives it the
environment the pipeline gave its rank and checks the count). TRL's settings that matter are explicit:
packing on (its default best-fit-decreasing, padding-free), assistant-only loss (TRL swaps in its Qwen3
training template with generation marks), bf16 off, gradient accumulation 1, no dataloader workers, no
reporting, no saves, seed 0.

  python -m bench.peers sft|dpo <run.json> <first_batch/rank0.safetensors> <steps>   train; one JSON line
  python -m bench.peers profile <run.json> <first_batch/rank0.safetensors>            one profiled SFT step each way

`sft` also scores, before training, the conversations of the pipeline's step-1 batch with TRL's own
compute_loss (the same rows: the pipeline packs conversations in its reading order, TRL reorders them by
length, so their step-1 batches otherwise differ). `dpo` samples pairs in the pipeline's reading order, so
every step holds the same pairs on both sides.
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time

import torch
from safetensors.torch import load_file

WARMUP_STEPS = 2  # as the pipeline's steady figure: the first two steps warm up allocator and kernels
PROFILE_REPEATS = 3


def _records(path: str) -> list[dict]:
    return [json.loads(line) for line in open(path) if line.strip()]


def _pipeline_order(records: list[dict]) -> list[dict]:
    """The order the pipeline reads a file in: torchtitan's ChatDataset (and the pipeline's preference dataset, the
    same way) shuffles it with datasets' seed 42 before dropping what does not fit."""
    from datasets import Dataset

    return [records[i] for i in Dataset.from_list([{"i": i} for i in range(len(records))]).shuffle(seed=42)["i"]]


def _fitting(records: list[dict], tokenizer, seq_len: int) -> list[dict]:
    """What the pipeline trains on: it drops a conversation (a pair) longer than seq_len, where TRL would cut it."""
    from pipeline.data.preference import split_pair

    def longest(record):
        sides = [record["messages"]] if "messages" in record else [split_pair(record)[0] + side
                                                                    for side in split_pair(record)[1:]]
        return max(len(tokenizer.apply_chat_template(m, tokenize=True, return_dict=True)["input_ids"]) for m in sides)

    return [record for record in records if longest(record) <= seq_len]


def _model(source: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)


def _args(cls, settings: dict, out: str, steps: int, **extra):
    return cls(**{"output_dir": out, "per_device_train_batch_size": settings["local_batch_size"], "max_steps": steps,
                  "learning_rate": settings["lr"], "lr_scheduler_type": "constant_with_warmup",
                  "warmup_steps": settings["warmup_steps"], "adam_beta1": 0.9, "adam_beta2": 0.95, "adam_epsilon": 1e-8,
                  "weight_decay": 0.0, "max_grad_norm": settings["max_norm"], "optim": "adamw_torch_fused",
                  "gradient_accumulation_steps": 1, "logging_steps": 1, "report_to": [], "save_strategy": "no",
                  "use_cpu": True, "bf16": False, "fp16": False, "seed": 0, "data_seed": 0, "dataloader_num_workers": 0,
                  "disable_tqdm": True, "max_length": settings["seq_len"], **extra})


def _sft_args(settings: dict, out: str, steps: int, **extra):
    from trl import SFTConfig

    return _args(SFTConfig, settings, out, steps, packing=True, assistant_only_loss=True, **extra)


ASSISTANT_BRANCH = ("{%- if loop.index0 > ns.last_query_index %}", "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}")


def _marked_template(template: str) -> str:
    """The checkpoint's own Qwen3 template with `{% generation %}` marks around each assistant turn: from after
    `<|im_start|>assistant\\n` through `<|im_end|>`, the tokens the pipeline labels (pipeline/data/chat.py)."""
    head, rest = template.split(ASSISTANT_BRANCH[0], 1)
    branch, tail = rest.split(ASSISTANT_BRANCH[1], 1)
    branch = ASSISTANT_BRANCH[0] + branch
    header = "'<|im_start|>' + message.role + '\\n"
    if branch.count(header) != 3:
        raise SystemExit("peers: the checkpoint's chat template is not the Qwen3 template this bench marks")
    branch = branch.replace(header + "<think>", "'<think>").replace(header + "' + content", "content")
    return (head + "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}" + branch
            + "{{- '<|im_end|>' }}{%- endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}" + tail)


def _sft_tokenizer(source: str, records: list[dict]):
    """The checkpoint's tokenizer with `{% generation %}` marks in its template, which TRL's assistant_only_loss
    needs. TRL 1.16 cannot patch the embedded Qwen3 tokenizer's template (the older Hub revision), and its own
    Qwen3 training template renders other tokens (an empty think block in every assistant turn, where Qwen3's
    template keeps it only after the last user turn), so the marks go into the checkpoint's own template; used
    only where it renders every conversation exactly as the unmarked one does."""
    from transformers import AutoTokenizer
    from trl.chat_template_utils import has_generation_markers

    tokenizer = AutoTokenizer.from_pretrained(source)
    if has_generation_markers(tokenizer.chat_template):
        return tokenizer
    own = [tokenizer.apply_chat_template(r["messages"], tokenize=False) for r in records]
    tokenizer.chat_template = _marked_template(tokenizer.chat_template)
    differ = sum(a != tokenizer.apply_chat_template(r["messages"], tokenize=False) for a, r in zip(own, records))
    if differ:
        raise SystemExit(f"peers: the marked template renders {differ} conversations otherwise than the checkpoint's")
    return tokenizer


def _first_batch_conversations(batch: dict, records: list[dict]) -> list[dict]:
    """The pipeline's step-1 conversations: it packs whole conversations in its reading order (`records` in that
    order), so they are the first n, n the row segments (positions restart at 0) that hold a labelled token (the rest is padding)."""
    n = 0
    for positions, labels in zip(batch["positions"], batch["labels"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [len(positions)]
        n += sum(bool((labels[a:b] != -100).any()) for a, b in zip(starts, starts[1:]))
    return records[:n]


class _Steps:
    """Per-step wall time and the tokens of each batch TRL's collator made (in step order)."""

    def __init__(self, collator):
        self.collator, self.batches, self.times, self._start = collator, [], [], 0.0

    def __call__(self, features):
        batch = self.collator(features)
        ids = batch["input_ids"]
        mask = batch.get("attention_mask")
        self.batches.append({"computed": ids.numel(), "real": int(mask.sum()) if mask is not None else ids.numel(),
                             "labelled": int((batch["labels"] != -100).sum()) if "labels" in batch
                             else int(batch["completion_mask"].sum())})
        return batch

    def callback(self):
        from transformers import TrainerCallback

        steps = self

        class Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                steps._start = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                steps.times.append(time.perf_counter() - steps._start)

        return Timer()


def _train(trainer, steps: int) -> dict:
    recorder = _Steps(trainer.data_collator)
    trainer.data_collator = recorder
    trainer.add_callback(recorder.callback())
    trainer.train()
    batches = recorder.batches[:steps]
    real = [b["real"] for b in batches]
    logs = [h for h in trainer.state.log_history if "loss" in h and "train_runtime" not in h]
    return {"step_times_s": recorder.times, "steady_step_s": statistics.median(recorder.times[WARMUP_STEPS:]),
            "real_tokens_per_step": real, "computed_tokens_per_step": [b["computed"] for b in batches],
            "labelled_tokens_per_step": [b["labelled"] for b in batches],
            "steady_tokens_per_s": statistics.median(r / t for r, t in zip(real[WARMUP_STEPS:], recorder.times[WARMUP_STEPS:])),
            "step1": logs[0], "threads": torch.get_num_threads()}


def sft(run: dict, batch_file: str, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    settings = run["settings"]
    records = _fitting(_pipeline_order(_records(run["data_file"])), AutoTokenizer.from_pretrained(run["source_dir"]),
                       settings["seq_len"])
    tokenizer = _sft_tokenizer(run["source_dir"], records)
    model = _model(run["source_dir"])
    out = tempfile.mkdtemp(prefix="peers-trl-")
    # The same rows: the pipeline's step-1 conversations in one batch, scored by TRL's compute_loss before training.
    first = load_file(batch_file)
    same = _first_batch_conversations(first, records)
    check = SFTTrainer(model=model, args=_sft_args(settings, out, 1, per_device_train_batch_size=len(same)),
                       train_dataset=Dataset.from_list(same), processing_class=tokenizer)
    inputs = check._prepare_inputs(next(iter(check.get_train_dataloader())))
    labelled = int((inputs["labels"] != -100).sum())
    with torch.no_grad():
        same_loss = float(check.compute_loss(model, inputs, num_items_in_batch=labelled))
    del check
    trainer = SFTTrainer(model=model, args=_sft_args(settings, out, steps), train_dataset=Dataset.from_list(records),
                         processing_class=tokenizer)
    packed = trainer.train_dataset
    lengths = [len(ids) for ids in packed["input_ids"]]
    result = _train(trainer, steps)
    result.update({"same_rows": {"conversations": len(same), "loss": same_loss, "labelled_tokens": labelled,
                                 "pipeline_labelled_tokens": int((first["labels"] != -100).sum())},
                   "packing": {"rows": len(lengths), "tokens": sum(lengths),
                               "efficiency": sum(lengths) / (len(lengths) * settings["seq_len"]),
                               "padding_free": bool(trainer.padding_free)}})
    return result


def dpo(run: dict, batch_file: str, steps: int) -> dict:
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    settings = run["settings"]
    tokenizer = AutoTokenizer.from_pretrained(run["source_dir"])
    args = _args(DPOConfig, settings, tempfile.mkdtemp(prefix="peers-trl-"), steps, beta=settings["dpo_beta"],
                 loss_type=[settings["dpo_loss"]], train_sampling_strategy="sequential")
    trainer = DPOTrainer(model=_model(run["source_dir"]), args=args, processing_class=tokenizer,
                         train_dataset=Dataset.from_list(_fitting(_pipeline_order(_records(run["data_file"])), tokenizer,
                                                                  settings["seq_len"])))
    return _train(trainer, steps)


def _attention_s(step) -> float:
    """Self CPU seconds of one step's attention ops (forward and backward), by torch's profiler."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step()
    return sum(e.self_cpu_time_total for e in prof.key_averages()
               if "attention" in e.key or "scaled_dot_product" in e.key) / 1e6


def _split(sides: dict[str, tuple]) -> dict:
    """Each side's step seconds: whole, the backbone alone (embedding, layers, final norm; forward and backward), the
    LM head and loss over the 151,936-word vocabulary (the difference), attention (profiled). The four timings
    alternate, PROFILE_REPEATS rounds, and the fastest of each counts: on a machine others share, the least
    disturbed run."""
    times: dict[tuple[str, str], list[float]] = {}
    cpu: dict[tuple[str, str], list[float]] = {}
    for round_ in range(PROFILE_REPEATS + 1):  # round 0 warms up allocator and kernels
        for name, (full, backbone, _, _) in sides.items():
            for part, step in (("full", full), ("backbone", backbone)):
                started, cpu_started = time.perf_counter(), time.process_time()
                step()
                if round_:
                    times.setdefault((name, part), []).append(time.perf_counter() - started)
                    # CPU seconds of this process's threads: what a time slice taken by another user leaves out
                    cpu.setdefault((name, part), []).append(time.process_time() - cpu_started)
    out = {}
    for name, (full, _, tokens, labelled) in sides.items():
        whole, body = min(times[name, "full"]), min(times[name, "backbone"])
        whole_cpu, body_cpu = min(cpu[name, "full"]), min(cpu[name, "backbone"])
        out[name] = {"tokens": tokens, "labelled": labelled, "step_s": whole, "backbone_s": body,
                     "lm_head_and_loss_s": whole - body, "attention_s": _attention_s(full), "tokens_per_s": tokens / whole,
                     "step_cpu_s": whole_cpu, "backbone_cpu_s": body_cpu, "lm_head_and_loss_cpu_s": whole_cpu - body_cpu}
    return out


def profile_step(run: dict, batch_file: str) -> dict:
    """Both sides' step-1 batches through the same transformers model, weights and threads, back to back in one
    process (so load from other users of the machine hits both alike): TRL's compute_loss on its own packed,
    padding-free batch (the LM head only where a label is), and the pipeline's batch ([B, seq_len] with its padding,
    block-causal mask; the LM head and cross-entropy on the labelled positions only, as pipeline.titan.labelled_loss
    computes them), the computation the overhead section measures as the pipeline's step within a few per cent
    (bench/bare_loop.py)."""
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import SFTTrainer

    from bench.bare_loop import block_causal_mask
    from pipeline.titan.labelled_loss import LabelledTokensLoss

    settings = run["settings"]
    records = _fitting(_records(run["data_file"]), AutoTokenizer.from_pretrained(run["source_dir"]), settings["seq_len"])
    model = _model(run["source_dir"])
    trainer = SFTTrainer(model=model, args=_sft_args(settings, tempfile.mkdtemp(prefix="peers-trl-"), 1),
                         train_dataset=Dataset.from_list(records),
                         processing_class=_sft_tokenizer(run["source_dir"], records))
    trl_batch = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    labelled = int((trl_batch["labels"] != -100).sum())

    def backward(loss):
        loss.backward()
        model.zero_grad(set_to_none=True)

    batch = load_file(batch_file)
    mask = block_causal_mask(batch["positions"])
    pipeline_inputs = {"input_ids": batch["input"], "position_ids": batch["positions"], "attention_mask": mask}

    labels = batch["labels"]
    labelled_positions = labels != -100
    pipeline_loss = LabelledTokensLoss(LabelledTokensLoss.Config())  # the pipeline's own loss, as its trainer builds it
    pipeline_loss.set_lm_head(model.lm_head)

    def pipeline_step():
        hidden = model.model(**pipeline_inputs).last_hidden_state
        loss, _ = pipeline_loss(hidden, labels, labelled_positions.sum())
        backward(loss)

    trl_inputs = {k: v for k, v in trl_batch.items() if k in ("input_ids", "position_ids", "attention_mask")}
    sides = {"trl": (lambda: backward(trainer.compute_loss(model, trl_batch, num_items_in_batch=labelled)),
                     lambda: backward(model.model(**trl_inputs).last_hidden_state.sum()),
                     trl_batch["input_ids"].numel(), labelled),
             # TRL's batch with the model's own loss (every position's logits): what TRL's fused LM head changes.
             "trl_full_logits": (lambda: backward(model(**trl_inputs, labels=trl_batch["labels"]).loss),
                                 lambda: backward(model.model(**trl_inputs).last_hidden_state.sum()),
                                 trl_batch["input_ids"].numel(), labelled),
             "pipeline": (pipeline_step, lambda: backward(model.model(**pipeline_inputs).last_hidden_state.sum()),
                          batch["input"].numel(), int(labelled_positions.sum()))}
    return {**_split(sides),
            "threads": torch.get_num_threads(), "repeats": PROFILE_REPEATS}


def main() -> None:
    mode, run_json, batch_file = sys.argv[1:4]
    run = json.loads(open(run_json).read())
    if mode == "profile":
        result = profile_step(run, batch_file)
    else:
        result = {"sft": sft, "dpo": dpo}[mode](run, batch_file, int(sys.argv[4]))
    print(json.dumps(result, default=float))


if __name__ == "__main__":
    main()
