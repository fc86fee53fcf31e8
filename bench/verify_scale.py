"""verify's time on a Hub-shaped Qwen3-0.6B with a trn2-shaped first batch, projected to Qwen3-4B
(issue 17 item 5.1). Measured once by hand, not a test:

    .venv/bin/python -m bench.verify_scale <work dir> [distinct batches] [copies each] [seq_len]

No training: the run dir is made from the resolved run (dry run) of the Hub-shaped checkpoint
(bench/hub_shaped.py), its "HF save" (step-N/hf) is the source in bfloat16 with every norm weight
nudged (so the export differs from the source and verify computes the source's loss, as after real
training), and first_batch/ holds `distinct` batches of `seq_len`
tokens of the held-out corpus, each recorded `copies` times (TP 4 on trn2: 16 distinct, 4 copies).
Two verifies run: the first path of the model (export's loss and the source's), then a second path
with the same batches (the source's loss read from runs/.reference_loss.json). Prints JSON: the
wall time of each, the time inside the loss forwards, and the projection to 4B.
"""

from __future__ import annotations

import json
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def make_run(root: Path, source: Path, path: str, distinct: int, copies: int, seq_len: int, step: int = 1):
    import torch
    from safetensors.torch import load_file, save_file

    from pipeline.checkpoint import corpus, hf_dir
    from pipeline.run import rundir, store
    from pipeline.training.resolve import RunRequest, resolve

    spec = resolve(RunRequest(model=str(source), path=path, dry_run=True,
                              checkpoints_root=root, flags={"steps": step, "nproc_per_node": 1}))
    run = store.home(str(source), root).run(path)
    if run.path.exists():
        shutil.rmtree(run.path)
    run.path.mkdir(parents=True)
    spec.run_dir = str(run.path)
    run.save_spec(spec)
    step_dir = run.step_dir(step)
    (step_dir / rundir.HF_WEIGHTS).mkdir(parents=True)
    for shard in hf_dir.shard_files(Path(spec.source_dir)):
        hf = {k: (v * 1.01 if k.endswith("norm.weight") else v).to(torch.bfloat16) for k, v in load_file(str(shard)).items()}
        save_file(hf, str(step_dir / rundir.HF_WEIGHTS / shard.name), metadata={"format": "pt"})
        del hf
    if (Path(spec.source_dir) / hf_dir.INDEX).exists():
        shutil.copy(Path(spec.source_dir) / hf_dir.INDEX, step_dir / rundir.HF_WEIGHTS / hf_dir.INDEX)
    (step_dir / ".metadata").write_bytes(b"")  # DCP's completion marker; its content is never read
    (step_dir / "__0_0.distcp").write_bytes(b"")  # its one rank's shard: a complete step
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(spec.source_dir)
    ids = []
    for doc in corpus.held_out_documents() * 50:
        ids += tokenizer(doc)["input_ids"] + [tokenizer.eos_token_id or 0]
        if len(ids) > distinct * (seq_len + 1):
            break
    run.first_batch.mkdir()
    for d in range(distinct):
        row = torch.tensor(ids[d * (seq_len + 1):(d + 1) * (seq_len + 1)])
        positions, at = torch.empty(seq_len, dtype=torch.long), 0
        for i in range(seq_len):  # documents restart their positions after each eos
            positions[i] = at
            at = 0 if row[i].item() == (tokenizer.eos_token_id or 0) else at + 1
        batch = {"input": row[:-1].clone().unsqueeze(0), "labels": row[1:].clone().unsqueeze(0), "positions": positions.unsqueeze(0)}
        for c in range(copies):
            save_file(batch, str(run.first_batch / f"rank{d * copies + c}.safetensors"))
    (run.path / "metrics.jsonl").write_text("")  # no logged loss: verify compares export and source
    return run, spec


def main() -> None:
    work = Path(sys.argv[1])
    distinct, copies, seq_len = (int(a) for a in (sys.argv[2:] + ["4", "4", "512"][len(sys.argv) - 2:])[:3])
    import transformers

    from bench import hub_shaped

    from pipeline.checkpoint import embedded, reference_loss
    from pipeline.checkpoint.arch import arch_from_config, load_arch
    from pipeline.stages import download
    from pipeline.outputs import export as export_stage
    from pipeline.outputs import verify as verify_stage

    transformers.utils.logging.disable_progress_bar()
    source = hub_shaped.make(work / "hub" / "Qwen3-0.6B", "Qwen3-0.6B", embedded.tokenizer_dir())
    root = work / "checkpoints"
    import argparse
    import os

    from pipeline import envvars

    os.environ[envvars.CHECKPOINTS] = str(root)
    download.run(argparse.Namespace(model=str(source), revision=None, force=False))
    forward = {"s": 0.0, "calls": 0}
    original = reference_loss.loss_terms

    def timed(model, batch):
        start = time.perf_counter()
        try:
            return original(model, batch)
        finally:
            forward["s"] += time.perf_counter() - start
            forward["calls"] += 1

    reference_loss.loss_terms = timed
    import torch

    out = {"distinct": distinct, "copies": copies, "seq_len": seq_len, "torch_threads": torch.get_num_threads(),
           "load_average_at_start": os.getloadavg()}
    for label, path in (("first_path", "native"), ("second_path", "hf")):
        run, spec = make_run(root, source, path, distinct, copies, seq_len)
        if label == "first_path":  # the source's loss computed here, not read from an earlier bench
            run.shared_reference_loss.unlink(missing_ok=True)
        target = export_stage.export(export_stage.ExportConfig(run, dtype="bfloat16"))
        forward.update(s=0.0, calls=0)
        start, cpu = time.perf_counter(), time.process_time()
        result = verify_stage.verify(target, Path(spec.source_dir), run, run.verify)
        wall = time.perf_counter() - start
        # CPU seconds of every thread: on a machine shared with others, the work itself.
        out[label] = {"verify_s": wall, "verify_cpu_s": time.process_time() - cpu,
                      "loss_forward_s": forward["s"], "loss_forward_calls": forward["calls"],
                      "passed": result.passed, "failed": [c.name for c in result.checks if not c.passed],
                      "source_loss": next(c.detail for c in result.checks if c.name == "step1-loss-export")[-160:]}
        print(json.dumps({label: out[label]}), file=sys.stderr, flush=True)  # kept even if a later part fails
    # Projection to Qwen3-4B on trn2 (64 files, 16 distinct, seq_len 4096): the forwards scale with
    # tokens × forward FLOP per token (a third of Qwen3Arch.flops_per_token, a training step's count),
    # the rest (hashing, comparing, loading) with the checkpoint's bytes.
    small = load_arch(source)
    big = arch_from_config(json.loads((REPO / "configs" / "hub_configs" / "Qwen3-4B-Instruct-2507.json").read_text()))
    tokens_small, tokens_big = distinct * seq_len, 16 * 4096
    flop_ratio = (big.flops_per_token(4096) * tokens_big) / (small.flops_per_token(seq_len) * tokens_small)
    byte_ratio = big.num_params / small.num_params
    first = out["first_path"]
    rest = first["verify_s"] - first["loss_forward_s"]
    per_model_forward = first["loss_forward_s"] / (first["loss_forward_calls"] / distinct)  # one call per distinct batch
    out["projection_4b"] = {
        "flop_ratio": flop_ratio, "byte_ratio": byte_ratio,
        "first_path_s": rest * byte_ratio + 2 * per_model_forward * flop_ratio,
        "later_paths_s": rest * byte_ratio + per_model_forward * flop_ratio,
        "three_paths_s": 3 * rest * byte_ratio + 4 * per_model_forward * flop_ratio,
        "three_paths_before_s": 3 * rest * byte_ratio + 6 * per_model_forward * flop_ratio * 4,
        "forward_flop_three_paths": 4 * tokens_big * big.flops_per_token(4096) / 3,
        "forward_flop_three_paths_before": 6 * 4 * tokens_big * big.flops_per_token(4096) / 3,
    }
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
