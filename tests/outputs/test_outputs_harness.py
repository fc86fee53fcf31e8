"""pipeline/outputs/harness.py: lm-evaluation-harness (the venv of `make setup-lm-eval`) on the tiny export, on
the tasks made of the run's held-out chat split; its numbers equal log-likelihoods computed here with
transformers alone, and land in the run's eval.json and the export's card."""

from __future__ import annotations

import json
import math
import re

import pytest
import torch

from helpers import REPO, fake_run, missing_tool, run_pipeline
from pipeline.checkpoint import manifest
from pipeline.outputs import export as export_stage, harness
from pipeline.run.rundir import RunDir

HARNESS = REPO / ".venv-lm-eval" / "bin" / "lm-eval"
LIMIT = 10


@pytest.fixture(scope="module")
def evaluated(export_runs, tmp_path_factory):
    """tiny's step-0 export (float32) of a run whose held-out split is tiny's chat_eval.jsonl, evaluated."""
    if not HARNESS.exists():
        missing_tool(f"no lm-evaluation-harness at {HARNESS}: `make setup-lm-eval` makes it (`make test` does)")
    run = fake_run(export_runs, tmp_path_factory.mktemp("eval"))
    spec = json.loads((run / "run.json").read_text())
    spec.update(eval_file=str(export_runs / "tiny" / "data" / "chat_eval.jsonl"), data_format="chat")
    (run / "run.json").write_text(json.dumps(spec))
    export_stage.export(export_stage.ExportConfig(RunDir(run), dtype="float32", step=0))
    record = harness.evaluate(RunDir(run), list(harness.LOCAL_TASKS), HARNESS, limit=LIMIT)
    return RunDir(run), record


def loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """log p(continuation | context), the continuation's tokens being those of context + continuation past
    the context's."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logits = model(torch.tensor([whole])).logits[0].double().log_softmax(-1)
    return sum(logits[i - 1, whole[i]].item() for i in range(start, len(whole)))


def test_the_harness_numbers_equal_loglikelihoods_computed_with_transformers(evaluated):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    run, record = evaluated
    model = AutoModelForCausalLM.from_pretrained(str(run.export), dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(run.export))
    tasks = run.path / "eval-tasks"
    docs = [json.loads(line) for line in (tasks / f"{harness.LOGLIKELIHOOD}.jsonl").read_text().splitlines()][:LIMIT]
    assert len(docs) == LIMIT and record["samples"][harness.LOGLIKELIHOOD] == LIMIT
    assert docs[0]["context"].endswith("<|im_start|>assistant") and docs[0]["continuation"].startswith("\n")
    ours = [loglikelihood(model, tokenizer, d["context"], d["continuation"]) for d in docs]
    theirs = record["tasks"][harness.LOGLIKELIHOOD]
    assert theirs["mean_loglikelihood"] == pytest.approx(sum(ours) / len(ours), rel=1e-5)
    assert theirs["perplexity"] == pytest.approx(math.exp(-sum(ours) / len(ours)), rel=1e-4)

    choice = [json.loads(line) for line in (tasks / f"{harness.CHOICE}.jsonl").read_text().splitlines()][:LIMIT]
    assert {d["gold"] for d in choice} == set(range(harness.CHOICES))
    scores = [[loglikelihood(model, tokenizer, d["context"], c) for c in d["choices"]] for d in choice]
    acc = sum(max(range(len(s)), key=s.__getitem__) == d["gold"] for s, d in zip(scores, choice)) / LIMIT
    acc_norm = sum(max(range(len(s)), key=lambda i: s[i] / len(d["choices"][i])) == d["gold"]
                   for s, d in zip(scores, choice)) / LIMIT
    assert record["tasks"][harness.CHOICE]["acc"] == pytest.approx(acc, abs=1e-9)
    assert record["tasks"][harness.CHOICE]["acc_norm"] == pytest.approx(acc_norm, abs=1e-9)


def test_the_results_are_the_run_s_eval_json_and_in_the_card(evaluated):
    run, record = evaluated
    written = json.loads((run.path / harness.EVAL_JSON).read_text())
    assert written == record and written["step"] == 0 and written["harness"] == "lm-eval 0.4.13"
    listed = manifest.check(run.export)  # the card changed, the manifest says so
    assert set(written["weights"]) == {p.name for p in run.export.glob("*.safetensors")}
    assert all(written["weights"][name] == listed["files"][name]["sha256"] for name in written["weights"])
    card = (run.export / "README.md").read_text()
    mean = record["tasks"][harness.LOGLIKELIHOOD]["mean_loglikelihood"]
    assert f"| lm-evaluation-harness | {harness.LOGLIKELIHOOD}: acc" in card and f"mean_loglikelihood {mean:.4f}" in card


def test_a_run_without_an_export_or_held_out_split_is_refused_in_one_line(export_runs, tmp_path):
    result = run_pipeline("eval", "--model", "tiny", "--path", "native", "--name", "nothing-here", root=export_runs,
                          check=False)
    assert result.returncode == 2 and result.stderr.startswith("error:") and "Fix:" in result.stderr
    run = fake_run(export_runs, tmp_path)
    export_stage.export(export_stage.ExportConfig(RunDir(run), dtype="float32", step=0))
    from pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match="no held-out split"):
        harness.evaluate(RunDir(run), list(harness.LOCAL_TASKS), HARNESS)


@pytest.mark.parametrize("name,body,data_format,says", [
    ("pairs.jsonl", '{"prompt": "q", "chosen": "a", "rejected": "b"}\n', "preference", "is preference data"),
    ("held.txt", "a document\n", "text", "in a .txt file"),
    ("held.jsonl", '{"text": "a b c d"}\n{not json\n', "text", "held.jsonl:2 is not JSON"),
    ("held.jsonl", b'{"text": "\xff"}\n', "text", "is not UTF-8"),
])
def test_a_held_out_file_the_tasks_cannot_read_is_one_line(tmp_path, name, body, data_format, says):
    from pipeline.errors import PipelineError
    from pipeline.outputs import harness

    path = tmp_path / name
    path.write_bytes(body if isinstance(body, bytes) else body.encode())
    with pytest.raises(PipelineError, match=re.escape(says)):
        harness.records(path, data_format, tmp_path)
