"""The export's README.md: a model card (huggingface_hub's ModelCard) saying what the checkpoint is —
base model and revision, data, steps, final and held-out eval loss, LoRA settings — so the export
directory is a model repository a team can share. No host paths: files are named by their base name.
"""

from __future__ import annotations

import json
from pathlib import Path

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


def render(run: RunDir, step: int, dtype: str) -> str:
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
        f"| verify | `make verify-checkpoint` writes its verdict to the run's verify.json |",
    ]
    card = ModelCard.from_template(data, template_str="---\n{{ card_data }}\n---\n\n{{ body }}\n",
                                   body="\n".join(lines))
    return str(card)


def write(directory: Path, run: RunDir, step: int, dtype: str) -> Path:
    path = Path(directory) / CARD
    path.write_text(render(run, step, dtype))
    return path
