"""pipeline/outputs/serve.py: vLLM (the CPU build of `make setup-vllm`) on float32 exports of tiny and tiny-moe.
vLLM gives transformers' greedy tokens, and log-probabilities within float32 rounding, for 3 prompts × 8 tokens: through
`generate` (vLLM's offline API) for tiny-moe and through `serve`'s HTTP completions for tiny (one engine start per
model, each ~50 s on 2 cores); bad input is one line before vLLM starts."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from helpers import REPO, TRAINED_STEPS, copy_model, fake_run, missing_tool, pipeline_env
from pipeline.errors import PipelineError
from pipeline.outputs import export as export_stage, serve
from pipeline.run.rundir import RunDir

VLLM = REPO / ".venv-vllm" / "bin" / "vllm"
PROMPTS = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4,"]
TOKENS = 8
MAX_MODEL_LEN = 128
# vLLM's CPU attention and sampler against transformers' eager float32 forward: measured |diff| ≤ 2e-5 on these
# exports; a wrong weight, rope_theta or norm moves the log-probabilities by far more.
LOGPROB_TOLERANCE = 2e-4
SERVE_START_S = 300


def _vllm() -> None:
    if not VLLM.exists():
        missing_tool(f"no vLLM at {VLLM}: `make setup-vllm` makes it (`make test` does)")


@pytest.fixture(scope="module", params=["tiny", "tiny-moe"])
def exported(request, export_runs, tmp_path_factory) -> RunDir:
    """The model's trained run (step 2) as run `run` of a root of its own, exported in float32."""
    root = copy_model(export_runs, tmp_path_factory.mktemp(request.param), request.param, link=True)
    (root / request.param / "runs").mkdir()
    run = RunDir(fake_run(export_runs, root / request.param / "runs", request.param, step=TRAINED_STEPS))
    export_stage.export(export_stage.ExportConfig(run, dtype="float32", step=TRAINED_STEPS))
    return run


def _transformers_greedy(export, prompt_ids: list[int]) -> tuple[list[int], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(export), dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), do_sample=False, max_new_tokens=TOKENS, min_new_tokens=TOKENS,
                             output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    tokens = out.sequences[0, len(prompt_ids):].tolist()
    logprobs = [torch.log_softmax(score[0].double(), -1)[token].item() for score, token in zip(out.scores, tokens)]
    return tokens, logprobs


def test_vllm_greedy_tokens_equal_transformers(exported):
    if exported.spec().model_key == "tiny":
        pytest.skip("tiny's tokens and log-probabilities are compared through the HTTP server")
    _vllm()
    from transformers import AutoTokenizer

    records = serve.generate(exported, PROMPTS, TOKENS, serve.ServeRequest(max_model_len=MAX_MODEL_LEN))
    assert [r["prompt"] for r in records] == PROMPTS
    tokenizer = AutoTokenizer.from_pretrained(str(exported.export))
    for record in records:
        assert record["prompt_token_ids"] == tokenizer(record["prompt"])["input_ids"]
        tokens, logprobs = _transformers_greedy(exported.export, record["prompt_token_ids"])
        assert record["token_ids"] == tokens, record["prompt"]
        assert record["logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), record["prompt"]
        assert record["text"] == tokenizer.decode(tokens)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_server_answers_completions_with_transformers_tokens(exported):
    if exported.spec().model_key != "tiny":
        pytest.skip("tiny-moe's tokens and log-probabilities are compared through `generate`")
    _vllm()
    port = _free_port()
    name = exported.path.name
    server = subprocess.Popen(
        [sys.executable, "-m", "pipeline", "serve", "--model", "tiny", "--path", "native", "--name", name,
         "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN)],
        cwd=REPO, env=pipeline_env(exported.path.parents[2]),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.time() + SERVE_START_S
        while True:
            assert server.poll() is None, f"the server stopped ({server.returncode}):\n{server.stdout.read()[-3000:]}"
            try:
                models = json.load(urllib.request.urlopen(f"{base}/v1/models", timeout=5))
                break
            except OSError:
                assert time.time() < deadline, f"no server at {base} after {SERVE_START_S} s"
                time.sleep(2)
        assert [m["id"] for m in models["data"]] == [name]
        body = json.dumps({"model": name, "prompt": PROMPTS, "max_tokens": TOKENS, "temperature": 0, "logprobs": 0,
                           "return_tokens_as_token_ids": True}).encode()
        request = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
        answer = json.load(urllib.request.urlopen(request, timeout=120))
    finally:
        server.terminate()  # the stage became vLLM's server (exec): it stops its engine processes itself
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
        time.sleep(2)
        leftover = subprocess.run(["pgrep", "-s", str(server.pid)], capture_output=True, text=True).stdout.split()
        if leftover:
            os.killpg(server.pid, signal.SIGKILL)
        assert not leftover, f"vLLM processes outlived the server's SIGTERM: {leftover}"
    assert server.returncode is not None
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(exported.export))
    choices = sorted(answer["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(PROMPTS)
    for prompt, choice in zip(PROMPTS, choices):
        tokens, logprobs = _transformers_greedy(exported.export, tokenizer(prompt)["input_ids"])
        assert choice["logprobs"]["tokens"] == [f"token_id:{token}" for token in tokens], prompt
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=LOGPROB_TOLERANCE), prompt
        assert choice["text"] == tokenizer.decode(tokens)
    assert answer["usage"]["completion_tokens"] == TOKENS * len(PROMPTS)


def test_the_command_serves_the_export_under_the_run_s_name_at_its_length(exported):
    _vllm()
    command = serve.serve_command(exported, serve.ServeRequest(vllm=VLLM))
    assert command[:5] == [str(VLLM.with_name("python")), "-m", "vllm.entrypoints.openai.api_server", "--model",
                           str(exported.export)]
    assert command[command.index("--served-model-name") + 1] == exported.path.name
    assert command[command.index("--max-model-len") + 1] == str(exported.spec().settings.seq_len)
    assert command[command.index("--dtype") + 1] == "float32"  # the export's: vLLM's "auto" serves it in bfloat16
    assert command[command.index("--kv-cache-memory-bytes") + 1] == str(2**30)
    assert "--enforce-eager" in command
    assert "--enforce-eager" not in serve.serve_command(exported, serve.ServeRequest(vllm=VLLM, compile=True))


def test_bad_requests_are_one_line_before_vllm_starts(exported, tmp_path, monkeypatch):
    def became_vllm(*args):
        raise AssertionError("the stage went on to exec vLLM")

    monkeypatch.setattr(serve.os, "execve", became_vllm)
    with pytest.raises(PipelineError, match="no vLLM at .*Fix: run `make setup-vllm`"):
        serve.generate(exported, PROMPTS, TOKENS, serve.ServeRequest(vllm=tmp_path / "vllm"))
    _vllm()
    with pytest.raises(PipelineError, match="PROMPT is empty"):
        serve.generate(exported, [""], TOKENS, serve.ServeRequest())
    with pytest.raises(PipelineError, match="MAX_TOKENS=0"):
        serve.generate(exported, PROMPTS, 0, serve.ServeRequest())
    with pytest.raises(PipelineError, match="MAX_MODEL_LEN=0"):
        serve.generate(exported, PROMPTS, TOKENS, serve.ServeRequest(max_model_len=0))
    with pytest.raises(PipelineError, match="KV_CACHE_GIB=0"):
        serve.generate(exported, PROMPTS, TOKENS, serve.ServeRequest(kv_cache_gib=0))
    unexported = RunDir(tmp_path / "run")
    unexported.path.mkdir()
    (unexported.path / "run.json").write_text((exported.path / "run.json").read_text())
    with pytest.raises(PipelineError, match="holds no export"):
        serve.serve(unexported, serve.ServeRequest())
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(PipelineError, match="something else listens there.*SERVE_PORT"):
            serve.serve(exported, serve.ServeRequest(port=taken.getsockname()[1]))
