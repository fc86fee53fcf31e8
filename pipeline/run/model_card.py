"""The export's README.md: a model card (huggingface_hub's ModelCard) saying what the checkpoint is —
base model and revision, data, steps, final and held-out eval loss, LoRA settings — so the export
directory is a model repository a team can share. No host paths: files are named by their base name.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline.checkpoint import manifest
from pipeline.fsutil import atomic_write_text
from pipeline.run.rundir import RunDir

CARD = "README.md"


def _source_record(spec) -> dict:
    """source.json of the run's model (its Hub commit), beside runs/; empty when absent."""
    try:
        return json.loads((Path(spec.run_dir).parent.parent / "source.json").read_text())
    except (OSError, ValueError):
        return {}


def _data_name(spec) -> str:
    if spec.data_kind == "file":
        return Path(spec.data_file).name if spec.data_file else spec.settings.dataset
    return spec.settings.dataset


def render(run: RunDir, step: int, dtype: str, verdict: str | None = None) -> str:
    from huggingface_hub import ModelCard, ModelCardData

    spec = run.spec()
    records = run.metric_records()
    final = next((r["loss"] for r in reversed(records) if r["step"] <= step), None)
    evals = [(r["step"], r["eval_loss"]) for r in records if isinstance(r.get("eval_loss"), (int, float))
             and r["step"] <= step]
    source = _source_record(spec)
    base = spec.model if source.get("kind") == "hub" else f"{spec.model} ({source.get('kind', 'local')})"
    revision = source.get("commit") or source.get("revision")
    s = spec.settings
    lora = (f"LoRA rank {s.lora_rank}, alpha {s.lora_alpha}, merged into the weights"
            if getattr(s, "lora_rank", 0) else "full fine-tuning (every weight)")
    data = ModelCardData(base_model=spec.model if source.get("kind") == "hub" else None, library_name="transformers",
                         pipeline_tag="text-generation", tags=["qwen3", "torchtitan", spec.path])
    lines = [
        f"# {Path(spec.run_dir).name}: {spec.model}, fine-tuned",
        "",
        f"Trained with torchtitan ({spec.path} path, {spec.target}) by this pipeline, exported at step {step} "
        f"in {dtype}.",
        "",
        "| | |", "|---|---|",
        f"| base model | {base}{f' @ {revision}' if revision else ''} |",
        f"| data | {_data_name(spec)} ({spec.data_format}{', loss on assistant turns' if spec.data_format == 'chat' else ''}) |",
        f"| steps | {step} of {s.steps} (seq_len {s.seq_len}, local batch {s.local_batch_size}, "
        f"{s.world_size} rank(s), lr {s.lr}) |",
        f"| method | {lora} |",
        f"| final training loss | {f'{final:.4f}' if final is not None else '—'} |",
        f"| held-out eval loss | {' → '.join(f'{v:.4f} (step {st})' for st, v in (evals[:1] + evals[-1:]) if evals) or '—'} |",
        f"| verify | {verdict or 'not verified yet (`make verify-checkpoint` writes its verdict here)'} |",
    ]
    card = ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n{{ body }}\n",
                                   body="\n".join(lines))
    return str(card)


def write(directory: Path, run: RunDir, step: int, dtype: str, verdict: str | None = None) -> Path:
    path = Path(directory) / CARD
    atomic_write_text(path, render(run, step, dtype, verdict))
    return path


def record_verdict(export: Path, run: RunDir, verification) -> None:
    """verify's verdict into the export's card, and with the card's new sha256 into manifest.json (where
    `publish` reads it), so the shared directory says whether it passed. Only the card is re-hashed."""
    listed = manifest.read(export)
    failed = [c for c in verification.checks if not c.passed]
    losses = verification.step1_loss
    if failed:
        verdict = f"FAILED {len(failed)} of {len(verification.checks)} checks (first: {failed[0].name})"
    else:
        verdict = f"passed all {len(verification.checks)} checks"
        if isinstance(losses.get("export"), float):
            verdict += f"; step-1 loss {losses['export']:.4f} (logged in training: {losses.get('logged') or '—'})"
    write(export, run, listed["step"], listed["dtype"], verdict)
    known = {name: entry["sha256"] for name, entry in listed["files"].items() if name != CARD}
    info = {k: v for k, v in listed.items() if k != "files"}
    manifest.write(export, {**info, "verify": {"passed": not failed, "detail": verdict}}, known=known)
