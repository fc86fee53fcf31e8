"""The torchrun command that starts a run's ranks: one node (standalone) or many (c10d rendezvous).

The launcher of every run is torchrun, on one host or on each node of a Slurm/EKS job; this
module only spells its command line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from pipeline.run import rundir
from pipeline.run.spec import RunSpec

ENTRY_MODULE = "pipeline.training.entry"
# In one shared log dir every node's torchrun writes <rdzv id>_<random>/attempt_0/<local rank 0..>, so
# which node wrote a log is lost; a subdir per node keeps it. The node's shell expands it (Slurm, an
# EKS Indexed Job, or NODE_RANK set by hand).
NODE_ID = "${SLURM_NODEID:-${JOB_COMPLETION_INDEX:-${NODE_RANK:-0}}}"
NODE_LOG_SUBDIR = f"node-{NODE_ID}"
RDZV_ENDPOINT = "${MASTER_ADDR}:${MASTER_PORT:-29500}"
RDZV_ID = "${RDZV_ID}"
# Every shell expansion this module writes into a multi-node command, for the node's shell to expand;
# whatever else a part holds (paths a user gave) is data (pipeline.launch.cluster quotes it as such).
NODE_EXPANSIONS = ("${SLURM_NODEID:-${JOB_COMPLETION_INDEX:-${NODE_RANK:-0}}}", "${MASTER_ADDR}",
                   "${MASTER_PORT:-29500}", "${RDZV_ID}")


def command(spec: RunSpec, python: str = sys.executable, run_json: str | None = None) -> list[str]:
    run_json = run_json or str(Path(spec.run_dir) / rundir.RUN_JSON)
    log_dir = f"{spec.run_dir}/{rundir.LOGS}"
    nnodes = spec.settings.nnodes
    if nnodes == 1:
        launch = ["--standalone", "--nnodes=1"]
    else:
        launch = [f"--nnodes={nnodes}", "--rdzv-backend=c10d", f"--rdzv-endpoint={RDZV_ENDPOINT}",
                  f"--rdzv-id={RDZV_ID}"]
        log_dir += f"/{NODE_LOG_SUBDIR}"
    return [python, "-m", "torch.distributed.run", *launch, f"--nproc-per-node={spec.settings.nproc_per_node}",
            "--local-ranks-filter=0", "--role=rank", "--tee=3", f"--log-dir={log_dir}", "-m", ENTRY_MODULE, run_json]
