"""One rank of the smoke test's all-reduce, started by torchrun (`python -m torch.distributed.run
--standalone --nproc-per-node 2 -m pipeline.host.smoke_collective BACKEND DEVICE OUT`): each rank adds
rank + 1 on its own device, and rank 0 writes what the sum came back as (pipeline.host.smoke reads it)."""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta


def main(backend: str, device_type: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    rank, local_rank, world = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device(device_type, local_rank) if device_type != "cpu" else torch.device("cpu")
    dist.init_process_group(backend=backend, timeout=timedelta(seconds=120))
    try:
        value = torch.full((8,), float(rank + 1), device=device)
        dist.all_reduce(value)
        got = value.cpu().tolist()
    finally:
        dist.destroy_process_group()
    if rank == 0:
        with open(out, "w") as handle:
            json.dump({"backend": backend, "device": str(device), "world": world, "got": got,
                       "expected": float(world * (world + 1) // 2)}, handle)


if __name__ == "__main__":
    main(*sys.argv[1:4])
