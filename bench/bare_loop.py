"""The bare PyTorch baseline for the overhead figure: the same Qwen3 weights (transformers'
model from the run's HF checkpoint), the same recorded batch, fp32, AdamW and clipping as
configs/cpu.toml, this process's default threads (what a 1-rank torchrun gets), no framework.

Usage: bare_loop.py <hf_dir> <first_batch/rank0.safetensors> <steps>; prints one JSON line.
"""

import json
import statistics
import sys
import time

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main() -> None:
    hf_dir, batch_file, steps = sys.argv[1], sys.argv[2], int(sys.argv[3])
    torch.manual_seed(0)
    batch = load_file(batch_file)
    inputs, labels = batch["input"], batch["labels"]
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-4, weight_decay=0.0)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        logits = model(input_ids=inputs, position_ids=batch["positions"]).logits
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - start)
    # Same exclusion as the pipeline's figure: the first two steps warm up allocator and kernels.
    print(json.dumps({"steady_step_s": statistics.median(times[2:]), "threads": torch.get_num_threads(),
                      "loss": float(loss)}))


if __name__ == "__main__":
    main()
