#!/usr/bin/env bash
# The GPU check of issue #8, prepared for a session that has an NVIDIA GPU (NOT run so far: the
# session that wrote it had none). On a randomly initialised Qwen3-0.6B-shaped checkpoint made
# here from configs/hub_configs/Qwen3-0.6B.json (no download), bf16, torch.compile, ~30 steps:
#   1. `python -m pipeline train --target cuda --path native` (configs/cuda.toml);
#   2. bare torchtitan (`torchtitan.train`, its own qwen3_0_6b config) on the same data and shapes;
#   3. tokens/s of both, and MFU against a bf16 matmul ceiling measured on this GPU.
# Usage: bench/cuda_check.sh [STEPS] ; writes $OUT (default /tmp/cuda_check)/cuda.json.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-.venv/bin/python}
STEPS=${1:-30}
OUT=${OUT:-/tmp/cuda_check}
export PIPELINE_CHECKPOINTS=$OUT/ckpt
mkdir -p "$OUT" "$PIPELINE_CHECKPOINTS"
nvidia-smi -L || { echo "error: no NVIDIA GPU visible. Fix: run this on a GPU machine." >&2; exit 2; }

# 1. A random Qwen3-0.6B-shaped HF checkpoint, with the Qwen tokenizer of the embedded tiny model.
$PY -m pipeline download --model tiny
$PY - "$OUT/Qwen3-0.6B" <<'PYEOF'
import json, shutil, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
out = Path(sys.argv[1])
if not (out / "config.json").exists():
    cfg = AutoConfig.for_model(**json.loads(Path("configs/hub_configs/Qwen3-0.6B.json").read_text()))
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).save_pretrained(out)
    tiny = Path(__import__("os").environ["PIPELINE_CHECKPOINTS"]) / "tiny" / "hf"
    for name in ("tokenizer.json", "tokenizer_config.json", "vocab.json", "merges.txt", "generation_config.json"):
        if (tiny / name).exists():
            shutil.copy(tiny / name, out / name)
PYEOF
$PY -m pipeline download --model "$OUT/Qwen3-0.6B"
$PY -m pipeline data --model Qwen3-0.6B

# 2. The pipeline's run.
$PY -m pipeline train --model Qwen3-0.6B --path native --target cuda --steps "$STEPS" --fresh

# 3. Bare torchtitan, same checkpoint, data, shapes, dtype and compile; its own trainer and config.
RUN=$PIPELINE_CHECKPOINTS/Qwen3-0.6B/native/run.json
$PY - "$RUN" "$STEPS" "$OUT/bare" <<'PYEOF' > "$OUT/bare_args"
import json, sys
spec = json.load(open(sys.argv[1]))
print(" ".join([
    "--module", "torchtitan.models.qwen3", "--config", "qwen3_0_6b", "--hf_assets_path", spec["hf_dir"],
    "--dump_folder", sys.argv[3], "--training.steps", sys.argv[2], "--training.seq_len", str(spec["seq_len"]),
    "--training.local_batch_size", str(spec["local_batch_size"]), "--training.mixed_precision_param", "bfloat16",
    "--compile.enable", "--checkpoint.no-enable", "--metrics.log_freq", "1"]))
PYEOF
DATA=$PIPELINE_CHECKPOINTS/Qwen3-0.6B/data/train.jsonl
# torchtitan.train cannot register a local dataset from its CLI: register ours as "c4", then run its main.
$PY -m torch.distributed.run --standalone --nnodes=1 --nproc-per-node=1 --tee=3 --log-dir="$OUT/bare/logs" \
  -c "import sys; from pipeline.titan_entry import _register_local_dataset as r; from torchtitan.hf_datasets.text_datasets import DATASETS; r('$DATA'); DATASETS['c4'] = DATASETS.pop('pipeline_local'); from torchtitan.train import main; sys.argv[1:] = open('$OUT/bare_args').read().split(); main()" \
  2>&1 | tee "$OUT/bare.log" || echo "bare torchtitan run failed: see $OUT/bare.log" >&2

# 4. Ceiling and summary.
$PY - "$PIPELINE_CHECKPOINTS/Qwen3-0.6B/native/metrics.jsonl" "$OUT/bare.log" "$OUT/cuda.json" <<'PYEOF'
import json, re, statistics, sys, time
import torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16); b = torch.randn_like(a)
for _ in range(3): a @ b
rates = []
for _ in range(10):
    torch.cuda.synchronize(); t = time.perf_counter(); [a @ b for _ in range(10)]; torch.cuda.synchronize()
    rates.append(10 * 2 * 8192**3 / (time.perf_counter() - t))
ceiling = max(rates)
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()][3:]
tps = statistics.median(r["tokens_per_s"] for r in rows)
mfu = statistics.median(r["mfu"] * r["peak_flops_per_rank"] / ceiling for r in rows)
bare = [float(x.replace(",", "")) for x in re.findall(r"tps: ([\d,]+)", open(sys.argv[2]).read())][3:]
result = {"gpu": torch.cuda.get_device_name(0), "bf16_matmul_ceiling_tflops": ceiling / 1e12,
          "pipeline_tokens_per_s": tps, "pipeline_mfu_vs_ceiling_pct": mfu,
          "bare_torchtitan_tokens_per_s": statistics.median(bare) if bare else None,
          "pipeline_over_bare": tps / statistics.median(bare) if bare else None, "steps_excluded": 3}
json.dump(result, open(sys.argv[3], "w"), indent=2); print(json.dumps(result, indent=2))
PYEOF
