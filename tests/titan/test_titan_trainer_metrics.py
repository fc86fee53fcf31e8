"""titan/trainer.py JsonlMetricsProcessor: throughput and MFU as torchtitan computes them (issue 12, finding 10)."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from pipeline.titan.trainer import JsonlMetricsProcessor, MetricsProcessor


def _processor(tmp_path, *, world: int, non_dp: int, ntokens: int, elapsed: float, flops_per_token: int = 0):
    proc = object.__new__(JsonlMetricsProcessor)  # no torchtitan build: only what log() reads
    proc.config = JsonlMetricsProcessor.Config(jsonl_path=str(tmp_path / "metrics.jsonl"), log_freq=1,
                                               flops_per_token=flops_per_token)
    proc.parallel_dims = SimpleNamespace(non_data_parallel_size=non_dp)
    proc.world_size, proc.is_writer = world, True
    proc.ntokens_since_last_log = ntokens
    proc.num_flops_per_token = 1000
    proc.gpu_peak_flops = 1e9
    proc.time_last_log = time.perf_counter() - elapsed
    proc.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: SimpleNamespace(max_reserved_gib=1.5))
    return proc


@pytest.fixture(autouse=True)
def _no_torchtitan_log(monkeypatch):
    monkeypatch.setattr(MetricsProcessor, "log", lambda *a, **k: None)


def _logged(tmp_path, **kwargs) -> dict:
    _processor(tmp_path, **kwargs).log(2, 3.0, 3.1, 0.5)
    return json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])


@pytest.mark.parametrize("world,tp", [(4, 2), (64, 4), (8, 1)])
def test_tokens_per_s_is_per_rank_times_world(tmp_path, world, tp):
    """Each rank counts its own batch (shared by its TP group). torchtitan's per-device rate is
    ntokens / (time · non-DP size); the job's rate is that × world = ntokens · DP ranks / time."""
    ntokens, elapsed = 4096, 2.0
    record = _logged(tmp_path, world=world, non_dp=tp, ntokens=ntokens, elapsed=elapsed)
    torchtitan_tps = ntokens / (elapsed * tp)  # torchtitan.components.metrics.MetricsProcessor.log
    dp = world // tp
    assert record["tokens_per_s_per_rank"] == pytest.approx(torchtitan_tps, rel=1e-2)
    assert record["tokens_per_s"] == pytest.approx(ntokens * dp / elapsed, rel=1e-2)
    assert record["tokens_per_s"] == pytest.approx(torchtitan_tps * world, rel=1e-2)


def test_mfu_uses_the_configured_flop_count(tmp_path):
    """The FLOP count comes from Qwen3Arch (the config), not from whichever path built the model."""
    record = _logged(tmp_path, world=2, non_dp=1, ntokens=1000, elapsed=1.0, flops_per_token=3000)
    assert record["flops_per_token"] == 3000
    assert record["mfu"] == pytest.approx(100 * 3000 * record["tokens_per_s_per_rank"] / 1e9)


def test_run_peak_memory_is_the_largest_read(tmp_path):
    """memory.json's peak (issue 17, 3.1): every logged step's read counts, not only the last one's — the
    monitor's peak restarts at each log."""
    proc = _processor(tmp_path, world=1, non_dp=1, ntokens=10, elapsed=1.0)
    proc.log(1, 3.0, 3.1, 0.5)  # reads 1.5
    proc.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: SimpleNamespace(max_reserved_gib=0.25))
    assert proc.run_peak_memory_gib() == 1.5
    proc.device_memory_monitor = SimpleNamespace(get_peak_stats=lambda: SimpleNamespace(max_reserved_gib=2.0))
    assert proc.run_peak_memory_gib() == 2.0


def test_step_1_writes_the_trainers_start_up_marks(tmp_path):
    """timings.json: the marks the trainer holds (PipelineTrainer.timings, shared with its metrics processor)
    and step 1's time, in that order; a processor without marks writes none."""
    bare = tmp_path / "bare"
    bare.mkdir()
    _processor(bare, world=1, non_dp=1, ntokens=10, elapsed=1.0).log(1, 3.0, 3.1, 0.5)
    assert not (bare / "timings.json").exists()
    proc = _processor(tmp_path, world=1, non_dp=1, ntokens=10, elapsed=1.0)
    proc.timings = {"entry": 1.0, "imported": 2.0, "threads": 2, "built": 3.0, "loaded": 4.0}
    proc.log(1, 3.0, 3.1, 0.5)
    marks = json.loads((tmp_path / "timings.json").read_text())
    step1 = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-1])["time"]
    assert list(marks.items()) == [*proc.timings.items(), ("step1", step1)]


def test_each_logged_step_prints_step_n_of_n_loss_tokens_per_s_and_an_eta(tmp_path, capsys):
    proc = _processor(tmp_path, world=2, non_dp=1, ntokens=512, elapsed=2.0)
    proc.total_steps = 10
    proc.log(1, 7.8821704, 7.9, 0.5)
    proc.time_last_log = time.perf_counter() - 1.0
    proc.log(2, 7.5, 7.6, 0.5)
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("step  1/10  loss 7.882170  512 tokens/s  ETA 0:")  # 2 s × 9 steps left: 0:18
    assert first == "step  1/10  loss 7.882170  512 tokens/s  ETA 0:18"
    assert second.startswith("step  2/10  loss 7.500000  1,024 tokens/s  ETA 0:0")  # the time since step 1 × 8
