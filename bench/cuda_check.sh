#!/usr/bin/env bash
# The GPU check of issue 14, prepared for a session that has an NVIDIA GPU (NOT run so far: the
# sessions that wrote it had none). One script, on one GPU:
#   1. a Qwen3-0.6B-shaped checkpoint made here (bench/hub_shaped.py: configs/hub_configs/Qwen3-0.6B.json,
#      random weights, bf16), imported as a local directory, trained with configs/cuda.toml (bf16,
#      torch.compile) for STEPS steps: MFU (the pipeline's FLOP count, the same for every path) against
#      the dense bf16 peak of pipeline/run/targets.py, goal ≥ 45 %; time to first step (timings.json);
#      peak memory (memory.json: allocator's peak reserved) against the estimate of pipeline/training/memory.py
#      (what `make train-* DRY_RUN=1` prints);
#   2. bare torchtitan (`torchtitan.train`, its own qwen3_0_6b config) on the same data and shapes, as a
#      reference for tokens/s;
#   3. tiny's step-1 loss in bf16 on the GPU against the same run in fp32 on the CPU, within the bf16
#      tolerance verify uses (pipeline/dtypes.py: DTYPES[...].logged_loss).
# Writes $OUT/cuda.json and puts it under the "cuda" key of bench/results.json.
# Usage: bench/cuda_check.sh [STEPS]   (OUT defaults to /tmp/cuda_check)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${1:-30}
OUT=${OUT:-/tmp/cuda_check}
export PIPELINE_CHECKPOINTS=$OUT/ckpt
mkdir -p "$OUT" "$PIPELINE_CHECKPOINTS"
nvidia-smi -L || { echo "error: no NVIDIA GPU visible. Fix: run this on a GPU machine." >&2; exit 2; }

# 1. The Hub-shaped checkpoint (tokenizer from the embedded tiny model) and the pipeline's run.
$PY -m pipeline download --model tiny
$PY -m bench.hub_shaped "$OUT/Qwen3-0.6B" Qwen3-0.6B "$PIPELINE_CHECKPOINTS/tiny/source"
MODEL="$OUT/Qwen3-0.6B"
$PY -m pipeline download --model "$MODEL"
$PY -m pipeline data --model "$MODEL"
$PY -m pipeline train --model "$MODEL" --path native --target cuda --dry-run > "$OUT/dry_run.txt"
$PY -m pipeline train --model "$MODEL" --path native --target cuda --steps "$STEPS" --fresh
RUN=$($PY -c "import sys; from pipeline.run import store; print(store.home(sys.argv[1]).run('native').path)" "$MODEL")

# 2. Bare torchtitan, same checkpoint, data, shapes, dtype and compile; its own trainer and config.
$PY - "$RUN/run.json" "$STEPS" "$OUT/bare" <<'PYEOF' > "$OUT/bare_args"
import json, sys
spec = json.load(open(sys.argv[1]))
s = spec["settings"]
print(" ".join([
    "--module", "torchtitan.models.qwen3", "--config", "qwen3_0_6b", "--hf_assets_path", spec["source_dir"],
    "--dump_folder", sys.argv[3], "--training.steps", sys.argv[2], "--training.seq_len", str(s["seq_len"]),
    "--training.local_batch_size", str(s["local_batch_size"]), "--training.mixed_precision_param", s["dtype"],
    "--compile.enable", "--checkpoint.no-enable", "--metrics.log_freq", "1"]))
PYEOF
DATA=$($PY -c "import sys; from pipeline.run import store; print(store.home(sys.argv[1]).data_file)" "$MODEL")
# torchtitan.train cannot register a local dataset from its CLI: register ours as "c4", then run its main.
$PY -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 --tee=3 --log-dir="$OUT/bare/logs" \
  -c "import sys; from pipeline.data import dataset as d; from torchtitan.hf_datasets.text_datasets import DATASETS; n = d.register(d.resolve('$DATA', None)); DATASETS['c4'] = DATASETS.pop(n); from torchtitan.train import main; sys.argv[1:] = open('$OUT/bare_args').read().split(); main()" \
  2>&1 | tee "$OUT/bare.log" || echo "bare torchtitan run failed: see $OUT/bare.log" >&2

# 3. tiny: step 1 in bf16 on the GPU and in fp32 on the CPU (same data, same first batch).
$PY -m pipeline data --model tiny
TINY=$($PY -c "from pipeline.run import store; print(store.home('tiny').run('native').path)")
$PY -m pipeline train --model tiny --path native --target cuda --steps 1 --fresh
cp "$TINY/metrics.jsonl" "$OUT/tiny_cuda_metrics.jsonl"
$PY -m pipeline train --model tiny --path native --target cpu --steps 1 --fresh
cp "$TINY/metrics.jsonl" "$OUT/tiny_cpu_metrics.jsonl"

# 4. Summary.
$PY - "$RUN" "$OUT" <<'PYEOF'
import json, re, statistics, sys
from pathlib import Path
from pipeline.dtypes import DTYPES
run, out = Path(sys.argv[1]), Path(sys.argv[2])
rows = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines() if l.strip()]
steady = rows[3:] or rows
timings = json.loads((run / "timings.json").read_text())
memory = json.loads((run / "memory.json").read_text())
bare = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", (out / "bare.log").read_text())][3:]
first = lambda p: json.loads(p.read_text().splitlines()[0])["loss"]
gpu_loss, cpu_loss = first(out / "tiny_cuda_metrics.jsonl"), first(out / "tiny_cpu_metrics.jsonl")
tps = statistics.median(r["tokens_per_s"] for r in steady)
result = {
    "gpu": None,
    "mfu_pct": statistics.median(r["mfu"] for r in steady), "target_mfu_pct": 45,
    "peak_flops_per_rank": steady[0]["peak_flops_per_rank"],
    "tokens_per_s": tps, "bare_torchtitan_tokens_per_s": statistics.median(bare) if bare else None,
    "pipeline_over_bare": tps / statistics.median(bare) if bare else None,
    "first_step_s": rows[0]["step_time_s"],
    "launch_to_step1_s": timings["step1"] - timings.get("launched", timings["entry"]),
    "peak_memory_gib": memory["peak_gib_per_rank"], "estimate_gib": memory["estimate_gib_per_rank"],
    "peak_over_estimate": memory["peak_over_estimate"],
    "tiny_step1_loss": {"cuda_bf16": gpu_loss, "cpu_fp32": cpu_loss, "abs_diff": abs(gpu_loss - cpu_loss),
                        "tolerance": DTYPES["bfloat16"].logged_loss,
                        "within": abs(gpu_loss - cpu_loss) <= DTYPES["bfloat16"].logged_loss},
    "steps": len(rows), "steps_excluded": 3,
}
import torch
result["gpu"] = torch.cuda.get_device_name(0)
(out / "cuda.json").write_text(json.dumps(result, indent=2) + "\n")
results = Path("bench/results.json")
data = json.loads(results.read_text()) if results.exists() else {}
data["cuda"] = result
data.setdefault("measured_at", {})["cuda"] = __import__("time").strftime("%Y-%m-%dT%H:%M:%S")
results.write_text(json.dumps(data, indent=2) + "\n")
print(json.dumps(result, indent=2))
PYEOF
