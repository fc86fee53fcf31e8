"""A run's export through EleutherAI's lm-evaluation-harness (lm-eval 0.4.x, its own venv: `make setup-lm-eval`),
on tasks defined here over the run's held-out split, and the results in the run's eval.json and the card.

The tasks are lm-eval task configs (docs/task_guide.md of the harness: `task`, `dataset_path: json` with
`data_files`, `output_type`, `doc_to_text`/`doc_to_target`/`doc_to_choice`, `metric_list`) over JSON-lines
files written here, one record per held-out document: the context (a conversation's turns before its
first assistant reply, in the tokenizer's chat template; a text's first half) and its continuation (that
reply; the rest). `pipeline_heldout_loglikelihood` scores each continuation (`loglikelihood`: perplexity
= exp(-mean log-likelihood per continuation), acc = greedy match); `pipeline_heldout_choice` is a
multiple choice between a document's own continuation and those of the next three documents
(`multiple_choice`: acc, acc_norm). Any other name (a task of the harness's own, e.g. hellaswag) is
passed to the harness as it is; those read their data from the Hub.
"""

from __future__ import annotations

import json
import math
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.flags import flag
from pipeline.fsutil import atomic_write_text

LOGLIKELIHOOD, CHOICE = "pipeline_heldout_loglikelihood", "pipeline_heldout_choice"
LOCAL_TASKS = (LOGLIKELIHOOD, CHOICE)
CHOICES = 4  # a document's continuation and the next three documents'
EVAL_JSON = "eval.json"
# `make setup-lm-eval`'s venv in the repository (the Makefile's LM_EVAL_VENV)
DEFAULT_HARNESS = Path(__file__).resolve().parents[2] / ".venv-lm-eval" / "bin" / "lm-eval"


@dataclass(frozen=True)
class EvalRequest:
    """What `make eval` asks for of a run's export (the run: RunRef). Its fields are the `eval` stage's flags
    (pipeline.flags) and Make variables (pipeline.host.makevars)."""

    tasks: str = flag(",".join(LOCAL_TASKS), "comma-separated lm-eval tasks: the local ones (default) and/or the "
                      "harness's own", make="EVAL_TASKS", make_help="eval: comma-separated lm-eval tasks (the local ones "
                      "over the run's held-out split, or the harness's own, which need the Hub)")
    limit: int | None = flag(None, "at most this many documents per task", make="EVAL_LIMIT",
                             make_help="eval: at most this many documents per task")
    harness: Path = flag(DEFAULT_HARNESS, "the lm-eval executable")


def records(eval_file: Path, data_format: str, tokenizer_dir: Path) -> list[dict]:
    """{context, continuation} per held-out document (see the module's docstring)."""
    from pipeline.fsutil import regular_file

    if data_format not in ("chat", "text") or Path(eval_file).suffix != ".jsonl":
        raise PipelineError(f"the local eval tasks read chat or text JSON lines; the run's held-out file {eval_file} is "
                            f"{data_format} data{'' if Path(eval_file).suffix == '.jsonl' else ' in a ' + Path(eval_file).suffix + ' file'}.",
                            "pass Hub task names (EVAL_TASKS=…), or evaluate a pretraining or chat run.")
    regular_file(Path(eval_file), "give the run a held-out .jsonl file (eval_dataset).")
    out = []
    tokenizer = None
    try:
        lines = Path(eval_file).read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as err:
        raise PipelineError(f"{eval_file} is not UTF-8 text ({err.reason} at byte {err.start}).",
                            "give the run a held-out .jsonl file in UTF-8 (eval_dataset).") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
        except json.JSONDecodeError as err:
            raise PipelineError(f"{eval_file}:{number} is not JSON ({err.msg}).",
                                "fix that line of the held-out file (eval_dataset).") from None
        if data_format == "chat":
            if tokenizer is None:
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
            messages = doc["messages"]
            first = next((i for i, m in enumerate(messages) if m["role"] == "assistant" and i), None)
            if first is None:
                continue
            context = tokenizer.apply_chat_template(messages[:first], add_generation_prompt=True, tokenize=False)
            out.append(_split(context, messages[first]["content"]))
        else:
            text = doc["text"] if isinstance(doc, dict) else str(doc)
            cut = text.find(" ", len(text) // 2)
            if cut > 0:
                out.append(_split(text[:cut], text[cut:]))
    if len(out) < CHOICES:
        raise PipelineError(f"{eval_file} holds {len(out)} usable held-out documents; the tasks need {CHOICES}.",
                            "give the run a larger held-out split (DATASET_EVAL_SPLIT, or a chat DATASET).")
    return out


def _split(context: str, continuation: str) -> dict:
    """The context's trailing whitespace (the chat template's newline after `assistant`) goes to the
    continuation, as the harness would move it anyway (lm_eval's `_encode_pair`): the records say exactly
    what is scored."""
    stripped = context.rstrip()
    return {"context": stripped, "continuation": context[len(stripped):] + continuation}


def write_tasks(docs: list[dict], directory: Path) -> None:
    """The two local tasks' data and configs in `directory` (the harness's --include_path). The configs are
    JSON, which is YAML."""
    directory.mkdir(parents=True, exist_ok=True)
    choice_docs = [{"context": d["context"], "gold": i % CHOICES,
                    "choices": _rotated([docs[(i + k) % len(docs)]["continuation"] for k in range(CHOICES)], i % CHOICES)}
                   for i, d in enumerate(docs)]
    for name, rows in ((LOGLIKELIHOOD, docs), (CHOICE, choice_docs)):
        (directory / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = {"dataset_path": "json", "test_split": "test", "doc_to_text": "{{context}}", "target_delimiter": ""}
    configs = {
        LOGLIKELIHOOD: {**common, "output_type": "loglikelihood", "doc_to_target": "{{continuation}}",
                        "metric_list": [{"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
                                        {"metric": "acc", "aggregation": "mean", "higher_is_better": True}]},
        CHOICE: {**common, "output_type": "multiple_choice", "doc_to_choice": "choices", "doc_to_target": "gold",
                 "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True},
                                 {"metric": "acc_norm", "aggregation": "mean", "higher_is_better": True}]},
    }
    for name, config in configs.items():
        config = {"task": name, **config, "dataset_kwargs": {"data_files": {"test": str(directory / f"{name}.jsonl")}}}
        (directory / f"{name}.yaml").write_text(json.dumps(config, indent=2) + "\n")


def _rotated(choices: list[str], gold: int) -> list[str]:
    """The document's own continuation (first) moved to position `gold`."""
    return choices[1:gold + 1] + choices[:1] + choices[gold + 1:]


def run_harness(harness: Path, export: Path, tasks: list[str], include: Path, limit: int | None) -> dict:
    """`lm-eval run` on the export (float32, CPU here; the harness picks the device where it has one);
    returns its results file's content."""
    if not Path(harness).is_file():
        raise PipelineError(f"no lm-evaluation-harness at {harness}.", "run `make setup-lm-eval` (`make eval` does).")
    with tempfile.TemporaryDirectory(prefix="lm-eval-") as out:
        command = [str(harness), "run", "--model", "hf", "--model_args", f"pretrained={export},dtype=float32",
                   "--tasks", ",".join(tasks), "--include_path", str(include), "--batch_size", "4",
                   "--output_path", out, *(["--limit", str(limit)] if limit else [])]
        print("running", " ".join(command), flush=True)
        result = subprocess.run(command, capture_output=True, text=True)
        if result.returncode != 0:
            tail = result.stderr.strip().splitlines()[-1:] or ["(no output)"]
            raise PipelineError(f"lm-eval failed on {export} ({tail[0]}).",
                                "run the command above to see its output; a Hub task needs the Hub.")
        found = sorted(Path(out).rglob("results_*.json"))
        if not found:
            raise PipelineError(f"lm-eval wrote no results under {out}.", "run the command above to see its output.")
        return json.loads(found[-1].read_text())


def summary(results: dict) -> dict:
    """task → {metric: value} (the harness's `metric,filter` keys without the filter, stderr left out), and for
    the log-likelihood task its mean log-likelihood per continuation (-ln perplexity)."""
    tasks = {}
    for task, values in results["results"].items():
        metrics = {key.split(",")[0]: value for key, value in values.items()
                   if "," in key and "_stderr" not in key and isinstance(value, (int, float))}
        if task == LOGLIKELIHOOD and metrics.get("perplexity"):
            metrics["mean_loglikelihood"] = -math.log(metrics["perplexity"])
        tasks[task] = metrics
    return tasks


def evaluate(run, tasks: list[str], harness: Path, limit: int | None = None) -> dict:
    """The run's export through the harness → <run dir>/eval.json (and a line in the export's card)."""
    from pipeline.checkpoint import manifest
    from pipeline.outputs import model_card

    spec = run.spec()
    export = run.export
    listed = manifest.check(export)  # the export as written: the record names what it describes
    include = run.path / "eval-tasks"
    if any(t in LOCAL_TASKS for t in tasks):
        if not spec.eval_file:
            raise PipelineError(f"run {run.path.name} has no held-out split (run.json eval_file), which the local "
                                "tasks are made of.", "train with a held-out split (make sft / make lora, or "
                                "DATASET_EVAL_SPLIT), or give Hub task names (EVAL_TASKS=hellaswag).")
        write_tasks(records(Path(spec.eval_file), spec.data_format, export), include)
    started = time.perf_counter()
    results = run_harness(harness, export, tasks, include, limit)
    weights = {name: entry["sha256"] for name, entry in listed["files"].items() if name.endswith(".safetensors")}
    record = {"step": listed["step"], "dtype": listed["dtype"], "weights": weights,
              "harness": f"lm-eval {_version(harness)}", "tasks": summary(results),
              "samples": {t: v.get("effective", v.get("original")) for t, v in results.get("n-samples", {}).items()},
              "limit": limit, "seconds": round(time.perf_counter() - started, 1),
              "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    atomic_write_text(run.path / EVAL_JSON, json.dumps(record, indent=2) + "\n")
    model_card.refresh(export, run)
    for task, metrics in record["tasks"].items():
        print(f"{task}: " + ", ".join(f"{k} {v:.4g}" for k, v in metrics.items()))
    return record


def _version(harness: Path) -> str:
    """lm_eval's installed version, as its venv's Python says it."""
    python = Path(harness).with_name("python")
    result = subprocess.run([str(python), "-c", "from importlib.metadata import version; print(version('lm_eval'))"],
                            capture_output=True, text=True)
    return result.stdout.strip() or "unknown"
