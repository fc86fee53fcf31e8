"""pipeline/console.py: the ranks' output filter (known noise and torchtitan's start-up log hidden, errors and
tracebacks always shown, VERBOSE=1 everything), the step line and its ETA; and the launcher passing both of
torchrun's streams through it."""

from __future__ import annotations

import sys

import pytest

from pipeline import console
from pipeline.console import NOISE, RankOutputFilter
from pipeline.launch import launcher

T = "[rank0]:[titan] 2026-12-04 18:47:21,150 - root - "
# Lines as a CPU run of `make pipeline` printed them (one of each kind of known noise).
NOISY = [
    f"{T}WARNING - Peak flops undefined for: cpu, fallback to A100",
    f"{T}WARNING - Error running lspci: [Errno 2] No such file or directory: 'lspci', fallback to use device_name",
    f"{T}WARNING - ENV[TORCH_NCCL_ASYNC_ERROR_HANDLING] = 1 will be overridden to 3 based on job config",
    "[rank0]:/x/torch/distributed/tensor/_random.py:76: UserWarning: DTensor random operators may not have complete "
    "support on cpu device mesh",
    "[rank0]:  if not is_rng_supported_mesh(device_mesh):",
    "[rank0]:/x/torchtitan/distributed/utils.py:311: UserWarning: DTensor manual_seed() may not have complete support "
    "on cpu device mesh",
    "[rank0]:  torch.distributed.tensor._random.manual_seed(seed, parallel_dims.world_mesh)",
    "[rank0]:/x/stateful_dataloader.py:379: UserWarning: 'set_vital' is deprecated, please do not call",
    '[rank0]:  torch.set_vital("Dataloader", "enabled", "True")  # type: ignore[attr-defined]',
    "[rank0]:/x/torchtitan/models/common/moe.py:298: UserWarning: In CPU autocast, but the target dtype is not "
    "supported. Disabling autocast.",
    "[rank0]:CPU Autocast only supports dtypes of torch.bfloat16, torch.float16 currently.",
    "[rank0]:  with torch.autocast(device_type=x_BLD.device.type, dtype=torch.float32):",
    "[rank0]:Generating train split: 67 examples [00:00, 23286.24 examples/s]",
    "*****************************************",
    "Setting OMP_NUM_THREADS environment variable for each process to be 1 in default, to avoid your system being "
    "overloaded, please further tune the variable for optimal performance in your application as needed. ",
    "*****************************************",
    f"{T}INFO - Building device mesh with parallelism: pp=1, dp_replicate=1, dp_shard=2, cp=1, tp=1, ep=1",
    f"{T}INFO - step:  1  loss:  7.88217  grad_norm:  0.5274  memory:  1.65GiB(7.01%)  tps: 62  tflops: 0.00  mfu: 3.99%",
    f"{T}INFO - Saving the checkpoint.",
    f"{T}INFO - Training starts at step 1",
    "[rank0]:",
    "",
]
SHOWN = [
    "[rank0]:step  1/10  loss 7.882170  132 tokens/s  ETA 0:12",
    "[rank0]:step 5: eval loss (held out) 7.100000",
    f"{T}WARNING - a warning nobody has seen before",
    "[rank0]:/x/y.py:3: FutureWarning: an unknown Python warning",
    f"{T}INFO - Loading the checkpoint from /c/tiny/runs/native/checkpoint/step-5.",
    f"{T}INFO - Training starts at step 6",
    "memory per rank (estimate): 0.77 GiB",
]
# Whatever else they match (a known noise pattern, torchtitan's INFO level), these pass.
ERRORS = [
    f"{T}ERROR - Peak flops undefined for: cpu, fallback to A100",
    f"{T}INFO - Error: Saving the checkpoint. failed",
    f"{T}CRITICAL - Generating train split: out of memory",
    "[rank0]:RuntimeError: CUDA error: no kernel image",
    "[rank1]:ValueError: seq_len 9000 exceeds max_position_embeddings 4096",
    "error: the data file is empty. Fix: give a file with documents.",
    "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
    "Root Cause (first observed failure):",
    "  exitcode  : -9 (pid: 123)",
    "[rank0]:  files  FAIL  24 tensors in 2 shards",
    "[rank0]:Generating train split: FAILED",
]
TRACEBACK = [
    "[rank0]:Traceback (most recent call last):",
    '[rank0]:  File "/x/torchtitan/trainer.py", line 1, in train',
    f"[rank0]:    {T}INFO - Saving the checkpoint.",  # a source line that looks like noise
    "[rank0]:",
    "[rank0]:During handling of the above exception, another exception occurred:",
    "[rank0]:  Peak flops undefined for: cpu, fallback to A100",
    "[rank0]:KeyboardInterrupt",
]


def test_known_noise_and_torchtitans_info_log_are_hidden_and_counted():
    output = RankOutputFilter()
    assert [line for line in NOISY if output.passes(line)] == []
    assert output.hidden == len(NOISY)
    for noise in NOISE:  # every pattern is exercised above
        assert any(noise.pattern.search(console.RANK_PREFIX.sub("", line)) for line in NOISY), noise.why


def test_step_lines_resumes_and_unknown_warnings_pass():
    output = RankOutputFilter()
    assert [line for line in SHOWN if output.passes(line)] == SHOWN and output.hidden == 0


@pytest.mark.parametrize("line", ERRORS)
def test_errors_always_pass(line):
    output = RankOutputFilter()
    assert output.passes(line)
    assert output.passes(NOISY[3]) is False and output.passes(line)  # even as the line a warning's "follows"


def test_a_traceback_passes_whole_and_the_filter_goes_on_after_it():
    output = RankOutputFilter()
    assert [output.passes(line) for line in TRACEBACK] == [True] * len(TRACEBACK)
    assert not output.passes(NOISY[0]) and output.passes(SHOWN[0])


def test_verbose_passes_everything(monkeypatch):
    output = RankOutputFilter(everything=True)
    assert all(output.passes(line) for line in NOISY) and output.hidden == 0
    monkeypatch.setenv("PIPELINE_VERBOSE", "1")
    monkeypatch.setenv("PIPELINE_BRIEF", "1")
    assert console.verbose() and not console.brief()
    monkeypatch.setenv("PIPELINE_VERBOSE", "0")
    assert not console.verbose() and console.brief()


def test_step_line_and_eta():
    assert console.step_line(3, 10, 7.1002681, 412.6, 65.2) == "step  3/10  loss 7.100268  413 tokens/s  ETA 1:05"
    assert console.step_line(1, 1, 2.0, 1e6, None) == "step 1/1  loss 2.000000  1,000,000 tokens/s"
    assert console.step_line(4, 0, 2.0, 10, None) == "step 4  loss 2.000000  10 tokens/s"  # N unknown
    assert console.duration(3723) == "1:02:03" and console.duration(-1) == "0:00"
    clock = console.StepClock(total=10)
    assert clock.eta(1, now=100.0, step_time_s=5.0) == 45.0  # step 1's own time: all it knows
    assert clock.eta(3, now=104.0, step_time_s=1.0) == 14.0  # 2 s per step since step 1, 7 to go
    assert console.StepClock(total=0).eta(1, now=0.0, step_time_s=1.0) is None
    resumed = console.StepClock(total=10)  # a resumed run: its first logged step is 6
    assert resumed.eta(6, now=0.0, step_time_s=1.0) == 4.0 and resumed.eta(8, now=3.0, step_time_s=1.0) == 3.0


PRINTS = "\n".join([
    "import sys",
    *[f"print({line!r}, file=sys.stderr)" for line in NOISY[:3] + ERRORS[:1]],
    *[f"print({line!r})" for line in SHOWN[:1] + NOISY[-5:-3]],
    "sys.exit(3)",
])


def test_the_launcher_filters_both_streams_and_keeps_the_raw_tail(capfd):
    code, tail = launcher._run_teeing_stderr([sys.executable, "-c", PRINTS], None, RankOutputFilter)
    out, err = capfd.readouterr()
    assert code == 3 and [line.rstrip("\n") for line in tail] == NOISY[:3] + ERRORS[:1]  # unfiltered: the failure's
    assert err.splitlines() == ERRORS[:1]
    assert out.splitlines() == [SHOWN[0], "(5 lines of torchtitan's start-up log and known warnings hidden; "
                                "VERBOSE=1 shows them, the run's logs/ has every rank's)"]
    code, _ = launcher._run_teeing_stderr([sys.executable, "-c", PRINTS], None, None)  # VERBOSE=1
    out, err = capfd.readouterr()
    assert len(err.splitlines()) == 4 and len(out.splitlines()) == 3
