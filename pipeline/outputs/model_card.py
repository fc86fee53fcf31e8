"""The export's README.md: a model card (huggingface_hub's ModelCard) saying what the checkpoint is —
base model and revision, data, steps, final and held-out eval loss, LoRA settings — so the export
directory is a model repository a team can share. No host paths: files are named by their base name.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.checkpoint import manifest
from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text, read_json_object
from pipeline.run.rundir import RunDir

CARD = "README.md"


def _source_record(spec) -> dict:
    """source.json of the run's model (its Hub commit), beside runs/; empty when absent."""
    try:
        return read_json_object(Path(spec.run_dir).parent.parent / "source.json", "run `make download` again.")
    except (OSError, PipelineError):
        return {}


def _data_name(spec) -> str:
    if spec.data_kind == "file":
        return Path(spec.data_file).name if spec.data_file else spec.settings.dataset
    return spec.settings.dataset


_DATA_NOTE = {"chat": ", loss on assistant turns", "preference": " pairs, log-probabilities over the completions"}


def base_model(spec) -> tuple[str, str | None, bool]:
    """(what a client loads the base model by, its revision, whether that is a Hub id): the Hub id and
    commit of a Hub source; a local or embedded source's checkpoint directory (a host path: the card says so)."""
    source = _source_record(spec)
    if source.get("kind") == "hub":
        return source.get("repo_id") or spec.model, source.get("commit") or source.get("revision"), True
    return str(spec.source_dir), None, False


def render(run: RunDir, step: int, dtype: str, verdict: str | None = None, adapter: bool = False) -> str:
    """`adapter`: the card of the LoRA adapters alone (export-adapter/), loaded over the base model."""
    from huggingface_hub import ModelCard, ModelCardData

    spec = run.spec()
    records = run.metric_records()
    final = next((r["loss"] for r in reversed(records) if r["step"] <= step), None)
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))
             and r["step"] <= step]
    source = _source_record(spec)
    hub_id, revision, on_hub = base_model(spec)
    base = hub_id if on_hub else f"{spec.model} ({source.get('kind', 'local')})"
    s = spec.settings
    lora = (f"LoRA rank {s.lora_rank}, alpha {s.lora_alpha}, "
            f"{'the adapters alone (PEFT)' if adapter else 'merged into the weights'}"
            if getattr(s, "lora_rank", 0) else "full fine-tuning (every weight)")
    if spec.data_format == "preference":  # the reference: pipeline.titan.dpo
        lora = (f"DPO (Direct Preference Optimization), β {s.dpo_beta}, {s.dpo_loss} loss, the reference the "
                f"{'base with its adapters off' if s.lora_rank else 'starting weights, frozen'}; {lora}")
    tags = ["qwen3", "torchtitan", spec.path] + ["lora"] * adapter + (["dpo"] if spec.data_format == "preference" else [])
    data = ModelCardData(base_model=hub_id if on_hub else None, library_name="peft" if adapter else "transformers",
                         pipeline_tag="text-generation", tags=tags)
    how = [f"LoRA adapters (PEFT's layout), exported at step {step} in {dtype}. Load them over the base model "
           "with `peft.AutoPeftModelForCausalLM.from_pretrained(<this repository>)`, which reads "
           "`base_model_name_or_path` from adapter_config.json."]
    if adapter and not on_hub:
        how.append(f"The base model is a {source.get('kind', 'local')} checkpoint, not a Hub repository: "
                   "`base_model_name_or_path` is its directory on the machine that trained it. Elsewhere, set it to "
                   "your copy of that checkpoint, or pass the base model to `PeftModel.from_pretrained`.")
    lines = [
        f"# {Path(spec.run_dir).name}: {spec.model}, {'LoRA adapter' if adapter else 'fine-tuned'}",
        "",
        f"Trained with torchtitan ({spec.path} path, {spec.target}) by this pipeline, "
        + (" ".join(how) if adapter else f"exported at step {step} in {dtype}."),
        "",
        "| | |", "|---|---|",
        f"| base model | {base}{f' @ {revision}' if revision else ''} |",
        f"| data | {_data_name(spec)} ({spec.data_format}{_DATA_NOTE.get(spec.data_format, '')}) |",
        f"| steps | {step} of {s.steps} (seq_len {s.seq_len}, local batch {s.local_batch_size}, "
        f"{s.world_size} rank(s), lr {s.lr}) |",
        f"| method | {lora} |",
        f"| final training loss | {f'{final:.4f}' if final is not None else '—'} |",
        f"| held-out eval loss | {' → '.join(f'{v:.4f} (step {st})' for st, v in (evals[:1] + evals[-1:]) if evals) or '—'} |",
        f"| verify | {verdict or 'not verified yet (`make verify-checkpoint` writes its verdict here)'} |",
    ]
    if not adapter and (evaluated := _evaluation(run, step, dtype)):
        lines.append(f"| lm-evaluation-harness | {evaluated} |")
    card = ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n{{ body }}\n",
                                   body="\n".join(lines))
    return str(card)


def _evaluation(run: RunDir, step: int, dtype: str) -> str | None:
    """`make eval`'s results (the run's eval.json) of this step's export in this dtype, in one line; None when there
    are none (an export re-made in another dtype was not evaluated)."""
    try:
        record = read_json_object(run.path / "eval.json", "run `make eval` again.")
    except (OSError, PipelineError):  # none yet, or torn: the card says nothing of it
        return None
    if record.get("step") != step or record.get("dtype") != dtype or not isinstance(record.get("tasks"), dict):
        return None
    shown = ("acc", "acc_norm", "mean_loglikelihood")
    parts = [f"{task}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k in shown)
             for task, metrics in record["tasks"].items() if isinstance(metrics, dict)]
    return f"{'; '.join(parts)} ({record.get('harness', 'lm-eval')})"


def write(directory: Path, run: RunDir, step: int, dtype: str, verdict: str | None = None,
          adapter: bool = False) -> Path:
    path = Path(directory) / CARD
    atomic_write_text(path, render(run, step, dtype, verdict, adapter))
    return path


def record_verdict(export: Path, run: RunDir, verification) -> None:
    """verify's verdict into the export's card, and with the card's new sha256 into manifest.json (where
    `publish` reads it), so the shared directory says whether it passed. Only the card is re-hashed."""
    failed = [c for c in verification.checks if not c.passed]
    losses = verification.step1_loss
    if failed:
        verdict = f"FAILED {len(failed)} of {len(verification.checks)} checks (first: {failed[0].name})"
    else:
        verdict = f"passed all {len(verification.checks)} checks"
        if isinstance(losses.get("export"), float):
            verdict += f"; step-1 loss {losses['export']:.4f} (logged in training: {losses.get('logged') or '—'})"
    refresh(export, run, {"passed": not failed, "detail": verdict})


def refresh(export: Path, run: RunDir, verify: dict | None = None) -> None:
    """The card written again (what verify and eval recorded: `verify`, or the manifest's), and its new
    sha256 into manifest.json; only the card is re-hashed."""
    listed = manifest.read(export)
    verify = verify if verify is not None else listed.get("verify")
    write(export, run, listed["step"], listed["dtype"], (verify or {}).get("detail"))
    known = {name: entry["sha256"] for name, entry in listed["files"].items() if name != CARD}
    info = {k: v for k, v in listed.items() if k not in ("files", "verify")}
    manifest.write(export, {**info, **({"verify": verify} if verify is not None else {})}, known=known)
