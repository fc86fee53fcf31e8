"""verify against the run that made the export (issue 19 item 7), each distinct first batch computed
once with the source's loss shared by a model's runs (issue 17 item 5.1), and the expected step-1
loss compared only under the settings it was measured under (issue 17 item 4)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from helpers import TRAINED_STEPS, plant_dcp_shards, read_metrics, run_dir as runs_dir, source_dir
from pipeline.checkpoint import hf_dir, manifest, reference_loss
from pipeline.checkpoint.arch import arch_from_config
from pipeline.errors import PipelineError
from pipeline.run import expectation
from pipeline.run.rundir import DCP_METADATA, HF_WEIGHTS, RunDir
from pipeline.run.settings import TrainSettings
from pipeline.run.spec import RunSpec
from pipeline.outputs import verify as verify_stage
from pipeline.outputs.verify import Verification, verify
from test_outputs_verify import checks, exports, runs  # noqa: F401 - session fixtures shared with that module

REPO = Path(__file__).resolve().parents[2]
TRAINED = ("tiny", TRAINED_STEPS, "bfloat16")


def tampered(export: Path, tmp_path: Path, edit) -> Path:
    """A copy of an export edited by `edit(dir)`, with manifest.json rewritten to match it."""
    out = tmp_path / "tampered"
    shutil.copytree(export, out)
    edit(out)
    info = {k: v for k, v in json.loads((out / manifest.MANIFEST).read_text()).items() if k != "files"}
    (out / manifest.MANIFEST).unlink()
    manifest.write(out, info)
    return out


def failing(result) -> set[str]:
    return {c.name for c in result.checks if not c.passed}


# ---- issue 19 item 7: the export against the run ------------------------------------------------

def test_an_untouched_export_equals_the_runs_saved_weights_and_architecture(runs, exports, tmp_path):
    result = verify(exports[TRAINED], source_dir(runs, "tiny"), RunDir(runs_dir(runs, "tiny", "native")),
                    tmp_path / "v.json")
    by_name = checks(result)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert by_name["weights"].detail.startswith("24/24 tensors bitwise equal to the run's step-2 weights")
    assert "bfloat16" in by_name["weights"].detail
    assert by_name["config"].detail == "config.json's architecture equals run.json's"


def test_one_tensor_changed_under_a_matching_manifest_fails(runs, exports, tmp_path, capsys):
    def nudge(directory: Path) -> None:
        shard = hf_dir.shard_files(directory)[0]
        state = load_file(str(shard))
        key = "model.layers.0.mlp.down_proj.weight" if "model.layers.0.mlp.down_proj.weight" in state else sorted(state)[0]
        state[key][0, 0] += 0.5
        save_file(state, str(shard), metadata={"format": "pt"})

    broken = tampered(exports[TRAINED], tmp_path, nudge)
    result = verify(broken, source_dir(runs, "tiny"), RunDir(runs_dir(runs, "tiny", "native")), tmp_path / "v.json")
    assert not result.passed and failing(result) == {"weights"}, result.checks
    by_name = checks(result)
    assert by_name["manifest"].passed and by_name["changed"].passed  # what passed it before
    assert by_name["weights"].detail.startswith("23/24 tensors bitwise equal")
    assert json.loads((tmp_path / "v.json").read_text())["passed"] is False


def test_rope_theta_changed_under_a_matching_manifest_fails(runs, exports, tmp_path):
    def rope(directory: Path) -> None:
        config = json.loads((directory / "config.json").read_text())
        if "rope_parameters" in config:
            config["rope_parameters"]["rope_theta"] *= 2
        else:
            config["rope_theta"] *= 2
        (directory / "config.json").write_text(json.dumps(config, indent=2))

    broken = tampered(exports[TRAINED], tmp_path, rope)
    result = verify(broken, source_dir(runs, "tiny"), RunDir(runs_dir(runs, "tiny", "native")), tmp_path / "v.json")
    assert not result.passed and failing(result) == {"config"}, result.checks
    assert "rope_theta" in checks(result)["config"].detail and "(run: " in checks(result)["config"].detail


def test_an_export_whose_step_the_run_no_longer_holds_fails(runs, exports, tmp_path):
    """No saved weights to compare with: verify cannot prove the export is the run's."""
    trained = runs_dir(runs, "tiny", "native")
    run = tmp_path / "runs" / "native"
    run.mkdir(parents=True)
    (run / "run.json").write_text((trained / "run.json").read_text())
    result = verify(exports[TRAINED], source_dir(runs, "tiny"), RunDir(run), tmp_path / "v.json")
    assert "weights" in failing(result)
    assert "cannot compare with the run's step-2 weights" in checks(result)["weights"].detail


# ---- issue 17 item 5.1: distinct batches, the source's loss once per model ----------------------

def _tiny_model():
    import transformers

    config = transformers.Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=8)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _batch(seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, 13), generator=generator)
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    return {"input": ids[:, :-1], "labels": ids[:, 1:], "positions": positions}


def test_duplicate_batches_are_computed_once_and_weighted_by_their_copies(monkeypatch):
    model = _tiny_model()
    a, b = _batch(1), _batch(2)
    recorded = [a, {k: v.clone() for k, v in b.items()}, {k: v.clone() for k, v in a.items()}, b, a]
    unique = reference_loss.distinct(recorded)
    assert [u.copies for u in unique] == [3, 2] and unique[0].digest == reference_loss.digest(a)
    # Every file, one by one, as verify computed it before:
    total = count = 0
    for batch in recorded:
        s, c = reference_loss.loss_terms(model, batch)
        total, count = total + s, count + c
    calls = []
    original = reference_loss.loss_terms
    monkeypatch.setattr(reference_loss, "loss_terms", lambda m, batch: calls.append(1) or original(m, batch))
    assert reference_loss.step1_loss(model, recorded) == pytest.approx(total / count, rel=1e-12)
    assert len(calls) == 2


def _copy_run(trained: Path, run: Path, step: int) -> None:
    """A run dir holding a trained run's record: run.json (re-pointed), metrics, first batch, one step's weights."""
    run.mkdir(parents=True)
    spec = json.loads((trained / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**spec, "run_dir": str(run)}))
    shutil.copy(trained / "metrics.jsonl", run / "metrics.jsonl")
    shutil.copytree(trained / "first_batch", run / "first_batch")
    (run / "checkpoint" / f"step-{step}").mkdir(parents=True)
    shutil.copy(trained / "checkpoint" / f"step-{step}" / DCP_METADATA, run / "checkpoint" / f"step-{step}" / DCP_METADATA)
    shutil.copytree(trained / "checkpoint" / f"step-{step}" / HF_WEIGHTS, run / "checkpoint" / f"step-{step}" / HF_WEIGHTS)
    plant_dcp_shards(trained / "checkpoint" / f"step-{step}", run / "checkpoint" / f"step-{step}")  # a complete step


def test_the_sources_loss_is_computed_once_for_every_path_of_a_model(runs, exports, tmp_path, monkeypatch):
    trained = runs_dir(runs, "tiny", "native")
    native, hf = tmp_path / "runs" / "native", tmp_path / "runs" / "hf"
    _copy_run(trained, native, TRAINED_STEPS)
    # TP-like duplicates: each rank's batch recorded twice (ranks 2, 3 copy ranks 0, 1).
    files = sorted((native / "first_batch").glob("rank*.safetensors"))
    for offset, file in enumerate(files):
        shutil.copy(file, native / "first_batch" / f"rank{len(files) + offset}.safetensors")
    shutil.copytree(native, hf)
    logged = read_metrics(trained)[0]["loss"]

    loads = []
    original = reference_loss.load_model
    monkeypatch.setattr(reference_loss, "load_model", lambda d: loads.append(d) or original(d))
    first = verify(exports[TRAINED], source_dir(runs, "tiny"), RunDir(native), tmp_path / "v1.json")
    assert first.passed, [c for c in first.checks if not c.passed]
    detail = checks(first)["step1-loss-source"].detail
    assert f"{2 * len(files)} file(s), {len(files)} distinct" in detail and "(plain transformers, computed)" in detail
    assert abs(first.step1_loss["reference"] - logged) < 1e-4  # duplicates weighted: the same mean
    assert len(loads) == 1
    cache = json.loads((tmp_path / "runs" / ".reference_loss.json").read_text())
    assert len(cache["batches"]) == len(files) and cache["source"]["reference"] == str(source_dir(runs, "tiny").resolve())

    second = verify(exports[TRAINED], source_dir(runs, "tiny"), RunDir(hf), tmp_path / "v2.json")
    assert second.passed and len(loads) == 1  # the other path's verify never loaded the source
    assert "computed by an earlier verify, .reference_loss.json" in checks(second)["step1-loss-source"].detail
    assert second.step1_loss["reference"] == first.step1_loss["reference"]


# ---- issue 17 item 4: the expected step-1 loss and its conditions -------------------------------

MODEL_4B = "Qwen/Qwen3-4B-Instruct-2507"


def _run_4b(tmp_path: Path, **settings) -> RunDir:
    config = json.loads((REPO / "configs" / "hub_configs" / "Qwen3-4B-Instruct-2507.json").read_text())
    run = tmp_path / "runs" / "native"
    run.mkdir(parents=True)
    RunDir(run).save_spec(RunSpec(model=MODEL_4B, model_key="Qwen--Qwen3-4B-Instruct-2507", path="native", target="trn2",
                                  source_dir=str(tmp_path / "source"), run_dir=str(run), arch=arch_from_config(config),
                                  settings=TrainSettings(seq_len=4096, dtype="bfloat16", **settings)))
    return RunDir(run)


def _expectation_of(run: RunDir, measured: float, tmp_path: Path, capsys) -> tuple[Verification, str]:
    result = Verification(tmp_path / "export", tmp_path / "source", run, tmp_path / "v.json")
    verify_stage._check_expectation(result, verify_stage.Batch([], "this run's first batch", measured, run))
    return result, capsys.readouterr().out


def test_a_run_on_other_data_is_not_comparable_with_6_54(tmp_path, capsys):
    """A correctly loaded 4B on C4 with its own tokenizer sits near 2.5-3.5: no check, no failure."""
    run = _run_4b(tmp_path, dataset="c4")
    result, out = _expectation_of(run, 2.9, tmp_path, capsys)
    assert result.checks == [] and result.expectation["comparable"] is False
    assert result.expectation["differing"] == {"dataset": {"run": "c4", "expected": "c4_test"},
                                               "tokenizer": {"run": "model", "expected": "titan-test"}}
    assert "step1-loss-expected: not comparable" in out and "dataset 'c4' ≠ 'c4_test'" in out
    assert "tokenizer 'model' ≠ 'titan-test'" in out and "unknown at the source, not compared: seq_len" in out
    assert result.to_dict()["step1_expectation"]["conditions"]["seq_len"]["basis"] == "unknown"


def test_a_loss_on_no_recorded_batch_is_not_comparable(tmp_path, capsys):
    """STEPS=0 and no sibling: the source's loss on a corpus document is not the logged step-1 loss."""
    run = _run_4b(tmp_path, dataset="c4_test", tokenizer="titan-test")
    result = Verification(tmp_path / "export", tmp_path / "source", run, tmp_path / "v.json")
    verify_stage._check_expectation(result, verify_stage.Batch([], "first held-out corpus document", None))
    assert result.checks == [] and result.expectation["comparable"] is False
    assert "none was logged with first held-out corpus document" in capsys.readouterr().out


@pytest.mark.parametrize("measured,passed", [(6.50, True), (2.9, False)])
def test_a_run_under_the_conditions_is_compared(tmp_path, capsys, measured, passed):
    run = _run_4b(tmp_path, dataset="c4_test", tokenizer="titan-test")
    result, _ = _expectation_of(run, measured, tmp_path, capsys)
    (check,) = result.checks
    assert check.name == "step1-loss-expected" and check.passed is passed and result.expectation["comparable"]
    assert "6.54 ± 0.1" in check.detail and "unknown at the source, not compared: seq_len" in check.detail
    assert "assumed: dataset, tokenizer, dtype" in check.detail


def test_models_toml_records_the_conditions_as_settings():
    expected = expectation.load(MODEL_4B)
    assert (expected.loss, expected.tolerance) == (6.54, 0.1)
    by_setting = {c.setting: c for c in expected.conditions}
    assert set(by_setting) == {"dataset", "tokenizer", "seq_len", "dtype"}
    assert by_setting["seq_len"].basis == "unknown" and by_setting["seq_len"].value is None
    assert all(c.note for c in expected.conditions)  # each says what it rests on
    for condition in expected.conditions:
        if condition.value is not None:  # every known value is one a run can be given
            TrainSettings(**{condition.setting: condition.value})


@pytest.mark.parametrize("conditions,message", [
    ('dataset = { value = "c4_test", basis = "guessed" }', "basis is 'guessed'"),
    ('dataset = { basis = "assumed" }', "a value is given exactly when the basis is not unknown"),
    ('dataset = { value = 4096, basis = "source" }', "is not a str"),
])
def test_malformed_expectations_are_refused_in_one_line(conditions, message):
    others = "\n".join(f'{k} = {{ basis = "unknown" }}' for k in ("tokenizer", "seq_len", "dtype"))
    text = f'["m/x".expected_step1]\nloss = 1.0\ntolerance = 0.1\nsource = "s"\n' \
           f'["m/x".expected_step1.conditions]\n{conditions}\n{others}\n'
    with pytest.raises(PipelineError) as err:
        expectation.load("m/x", text)
    assert message in err.value.problem and "\n" not in err.value.problem


# ---- the step-1 loss against plain transformers, gated only by a tolerance measured on the target ------

def _logged_vs_source(run: RunDir, reference: float, logged: float, tmp_path: Path) -> Verification:
    result = Verification(tmp_path / "export", tmp_path / "source", run, tmp_path / "v.json")
    verify_stage._check_logged_loss(result, reference, logged, "source vs logged")
    return result


def test_trn2_reports_the_step1_difference_until_a_trn2_measurement_is_recorded(tmp_path, capsys):
    """0.02 was measured on tiny in float32 on CPU: on trn2 (bf16, 36 layers) the difference is shown
    and recorded, and no run fails on it while configs/step1_tolerance.toml holds no trn2 entry."""
    from pipeline.outputs import tolerance

    assert tolerance.logged_loss("trn2", "bfloat16") is None  # what the committed file says today
    result = _logged_vs_source(_run_4b(tmp_path, dataset="c4"), 2.90, 2.95, tmp_path)
    assert result.checks == []  # nothing gated, so nothing can fail
    (entry,) = result.to_dict()["reported"]
    assert entry["name"] == "step1-loss-source" and abs(entry["value"] - 0.05) < 1e-9
    verify_stage.print_table(result)  # the table shows what is reported, once
    out = capsys.readouterr().out
    assert re.search(r"^  step1-loss-source +report  .*not gated: no tolerance measured on trn2 in bfloat16", out, re.M)


def test_a_recorded_trn2_measurement_gates(tmp_path, monkeypatch):
    from pipeline.outputs import tolerance

    recorded = tmp_path / "step1_tolerance.toml"
    recorded.write_text('[trn2.bfloat16]\ntolerance = 0.04\nmeasured = [0.012, 0.031]\nsource = "trn2 run, 2027"\n')
    monkeypatch.setattr(tolerance, "TOLERANCE_FILE", recorded)
    run = _run_4b(tmp_path, dataset="c4")
    (check,) = _logged_vs_source(run, 2.90, 2.93, tmp_path).checks
    assert check.name == "step1-loss-source" and check.passed and "≤ 0.04 (trn2, bfloat16" in check.detail
    assert "measured [0.012, 0.031], trn2 run, 2027" in check.detail
    (check,) = _logged_vs_source(run, 2.90, 2.95, tmp_path).checks
    assert not check.passed  # 0.05 > 0.04


def test_cpu_keeps_the_tolerance_measured_on_tiny(tmp_path):
    from pipeline.outputs import tolerance

    assert tolerance.logged_loss("cpu", "bfloat16").value == 2e-2 and tolerance.logged_loss("cpu", "float32").value == 1e-4
    assert tolerance.logged_loss("cuda", "bfloat16") is None  # never measured on a GPU: reported there too


@pytest.mark.parametrize("entry, message", [
    ("tolerance = 0.04\nsource = \"s\"\n", "needs tolerance > 0, measured"),
    ("tolerance = 0.01\nmeasured = [0.02]\nsource = \"s\"\n", "below a difference it records"),
])
def test_a_malformed_tolerance_record_is_refused_in_one_line(tmp_path, entry, message):
    from pipeline.outputs import tolerance

    path = tmp_path / "t.toml"
    path.write_text(f"[trn2.bfloat16]\n{entry}")
    with pytest.raises(PipelineError) as err:
        tolerance.logged_loss("trn2", "bfloat16", path)
    assert message in err.value.problem and "\n" not in err.value.problem
