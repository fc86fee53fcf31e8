"""The bare PyTorch baseline for the overhead figure: the same computation as the pipeline's
step, without the framework. The same Qwen3 weights (transformers' model from the run's source
checkpoint), the same recorded batch with the same block-causal document mask (so the step-1 loss
equals the pipeline's logged one: run.py checks it), the same loss normalisation, AdamW as
torchtitan builds it (fused, betas 0.9/0.95, eps 1e-8, the run's lr, no weight decay), the same
gradient clipping, fp32, and this process's default threads (what a 1-rank torchrun gets; run.py
checks the pipeline's rank had as many).

Usage: bare_loop.py <run.json> <first_batch/rank0.safetensors> <steps>; prints one JSON line.
"""

import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def block_causal_mask(positions: torch.Tensor) -> torch.Tensor:
    """[B, 1, S, S] bool: causal within each document; documents start where positions restart."""
    doc = torch.cumsum((positions == 0).to(torch.int32), dim=1)
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


def main() -> None:
    run = json.loads(open(sys.argv[1]).read())
    batch_file, steps = sys.argv[2], int(sys.argv[3])
    settings = run["settings"]
    torch.manual_seed(0)
    batch = load_file(batch_file)
    inputs, labels, positions = batch["input"], batch["labels"], batch["positions"]
    model = AutoModelForCausalLM.from_pretrained(run["source_dir"], dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings["lr"], betas=(0.9, 0.95), eps=1e-8,
                                  weight_decay=0.0, fused=True)
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        mask = block_causal_mask(positions)
        logits = model(input_ids=inputs, position_ids=positions, attention_mask=mask).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum") / labels.numel()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings["max_norm"], foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        times.append(time.perf_counter() - start)
    # Same exclusion as the pipeline's figure: the first two steps warm up allocator and kernels.
    print(json.dumps({"steady_step_s": statistics.median(times[2:]), "step_times_s": times,
                      "threads": torch.get_num_threads(), "step1_loss": losses[0]}))


if __name__ == "__main__":
    main()
