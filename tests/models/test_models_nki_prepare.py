"""The nki path's start-up plan (pipeline.models.nki.prepare), as a user meets it in dry runs: which
overrides attach to which model, which are skipped and why, and the constraint policy per override."""


from helpers import dry_run_spec, run_pipeline


def _spec(stdout: str) -> dict:
    return dry_run_spec(stdout)


def _use_nki(spec: dict) -> dict:
    return {target.rsplit(".", 1)[-1]: kwargs["use_nki"] for target, kwargs in
            (entry for entry in spec["overrides"] if isinstance(entry, list))}


def test_dense_model_takes_rope_alone_on_trn2(tmp_path):
    # The first real run: MoE kernel rules used to refuse this dense model
    # ("moe_cte: intermediate_per_tp_rank=0 must be in 2048..16384").
    result = run_pipeline("train", "--model", "Qwen/Qwen3-4B-Instruct-2507", "--path", "nki", "--target", "trn2",
                          "--seq-len", "4096", "--dry-run", root=tmp_path)
    assert "nki overrides attached: nki_rope (rope_hf)" in result.stdout
    for name in ("nki_router", "nki_experts"):
        assert f"nki override skipped: {name}: the model is dense (no experts)" in result.stdout
    spec = _spec(result.stdout)
    assert _use_nki(spec) == {"nki_rope": True}
    assert spec["nki"]["matched"]["pipeline.models.nki.overrides.nki_rope"] == 36
    assert not any("nki_router" in name or "nki_experts" in name for name in spec["nki"]["matched"])
    assert "--nproc-per-node=64" in result.stdout


def test_moe_model_outside_moe_cte_refuses_under_error_policy(tmp_path):
    result = run_pipeline("train", "--model", "Qwen/Qwen3-30B-A3B", "--path", "nki", "--target", "trn2", "--dry-run",
                          root=tmp_path, check=False)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: moe_cte: intermediate_per_tp_rank=192")  # 768 / TP 4
    assert "override nki_experts" in lines[0] and 'constraint_policy = "fallback"' in lines[0]


def test_fallback_policy_sends_only_the_failing_override_to_its_reference(tmp_path):
    config = tmp_path / "fallback.toml"
    config.write_text('[paths.nki]\nconstraint_policy = "fallback"\n')
    result = run_pipeline("train", "--model", "Qwen/Qwen3-30B-A3B", "--path", "nki", "--target", "trn2", "--dry-run",
                          "--config", str(config), root=tmp_path)
    warnings = [line for line in result.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1  # said once, at start-up, for the one override that falls back
    assert warnings[0].startswith("warning: nki_experts runs its PyTorch reference instead of moe_cte: moe_cte: "
                                  "intermediate_per_tp_rank=192")
    assert "nki overrides attached: nki_rope (rope_hf), nki_router (router_topk), nki_experts (reference)" in result.stdout
    assert _use_nki(_spec(result.stdout)) == {"nki_rope": True, "nki_router": True, "nki_experts": False}
