"""The device smoke test (stage `smoke`; `make smoke` runs verify-kernels after it): the first thing that
touches the devices, in seconds, before any 64-rank job does.

  devices      torch sees the node's logical NeuronCores: 16 Trainium2 chips × 8 physical cores / LNC
               (64 at LNC=2), one per rank of the trn2 plan
  op           one matmul on `neuron` against the same in float32 on the CPU
  all-reduce   two ranks started by torchrun, backend `neuron`, one device each: every rank gets the sum
  rope         nki-library's rope_hf kernel at the run's LNC (its sequence a multiple of 128 × LNC)
               against torchtitan's CosSinRoPE in float32, forward and backward (kernel_check's case)

On any other target the CPU equivalents run for real (the op on the CPU, the all-reduce over gloo, the
RoPE op's reference dispatch against CosSinRoPE) and the table says, row by row, what was skipped for
lack of a device. On trn2 a missing device is a failure, never a skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from pipeline.run import targets

PASS, FAIL, SKIPPED = "pass", "FAIL", "skipped"
COLLECTIVE_RANKS = 2
COLLECTIVE_TIMEOUT_S = 600  # the first collective on neuron may compile


@dataclass(frozen=True)
class Row:
    name: str
    status: str
    detail: str
    seconds: float = 0.0


def logical_cores(lnc: int) -> int:
    return targets.TRN2.chips * targets.TRN2.physical_cores_per_chip // lnc


def _timed(name: str, check) -> Row:
    started = time.monotonic()
    try:
        status, detail = check()
    except Exception as err:  # noqa: BLE001 - every failure of a check is that check's FAIL row
        status, detail = FAIL, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"[:400]
    return Row(name, status, detail, time.monotonic() - started)


def device_count(on_device: bool, lnc: int):
    if not on_device:
        return SKIPPED, "no `neuron` device on this target"
    import torch
    import torch_neuronx  # noqa: F401 - registers the `neuron` device (PrivateUse1)

    # torch.neuron is the `neuron` device module, as torch.cuda is CUDA's (torch/reference/api/torch-neuron-module)
    found, wanted = torch.neuron.device_count(), logical_cores(lnc)
    detail = (f"{found} `neuron` devices; the trn2 plan wants {wanted} (16 chips × 8 physical cores / LNC {lnc}), "
              "one per rank")
    return (PASS if found >= wanted else FAIL), detail


def one_op(on_device: bool):
    import torch

    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(256, 512, generator=gen), torch.randn(512, 128, generator=gen)
    want = (a.double() @ b.double()).float()
    device = "neuron" if on_device else "cpu"
    got = (a.to(device) @ b.to(device)).cpu()
    rel = ((got - want).abs().max() / want.abs().max()).item()
    # bf16-level: whether the device computes a float32 matmul in full float32 is not documented here
    bound = 2e-2 if on_device else 1e-5
    where = "on `neuron`" if on_device else "on the CPU (no device)"
    return (PASS if rel <= bound else FAIL), f"matmul [256×512]·[512×128] {where} vs float64: max rel error {rel:.1e} ≤ {bound:g}"


def all_reduce(on_device: bool, lnc: int):
    backend, device = ("neuron", "neuron") if on_device else ("gloo", "cpu")
    with tempfile.TemporaryDirectory(prefix="smoke-") as tmp:
        out = Path(tmp) / "all_reduce.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={COLLECTIVE_RANKS}",
                   "-m", "pipeline.host.smoke_collective", backend, device, str(out)]
        env = targets.TARGETS["trn2" if on_device else "cpu"].launch_env(dict(os.environ))
        if on_device:
            env[targets.LNC_ENV] = str(lnc)
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=COLLECTIVE_TIMEOUT_S)
        if result.returncode != 0 or not out.exists():
            tail = [line for line in (result.stderr + result.stdout).splitlines() if line.strip()][-1:] or ["no output"]
            return FAIL, f"torchrun, {COLLECTIVE_RANKS} ranks, backend {backend}: exit {result.returncode}: {tail[0][:300]}"
        return verdict(json.loads(out.read_text()))


def verdict(record: dict):
    """The all-reduce's sum as rank 0 saw it, against 1 + 2 + … + world."""
    ok = all(value == record["expected"] for value in record["got"])
    return (PASS if ok else FAIL), (f"backend {record['backend']}, {record['world']} ranks ({record['device']} on rank 0): "
                                    f"sum {sorted(set(record['got']))} (expected {record['expected']:g})")


def rope(on_device: bool, lnc: int):
    from pipeline.models.nki.kernel_check import cases, verify

    (case,) = [c for c in cases(lnc) if c.override == "nki_rope"][:1]
    (row,) = verify([case], ["float32"], device="neuron" if on_device else "cpu", use_nki=on_device)
    runs = f"rope_hf kernel at LNC={lnc}" if on_device else "the RoPE op's reference dispatch (no device: no kernel)"
    detail = (f"{runs}, {case.shape}, vs {row['vs']}: max rel error {row['max_rel']:.1e} ≤ {row['threshold']:g}"
              + (f" ({row['error']})" if row.get("error") else ""))
    return (PASS if row["pass"] else FAIL), detail


def run(target: str, lnc: int) -> list[Row]:
    on_device = target == "trn2"
    rows = [_timed("devices", lambda: device_count(on_device, lnc))]
    if on_device and rows[0].status != PASS:  # nothing below can run without the devices
        return rows + [Row(name, FAIL, "not run: the device check failed") for name in ("op", "all-reduce", "rope")]
    rows.append(_timed("op", lambda: one_op(on_device)))
    rows.append(_timed("all-reduce", lambda: all_reduce(on_device, lnc)))
    rows.append(_timed("rope", lambda: rope(on_device, lnc)))
    return rows


def table(rows: list[Row], target: str, lnc: int) -> str:
    lines = [f"smoke on {target}:"] + [f"  {r.name:<11} {r.status:<7} {r.seconds:6.1f} s  {r.detail}" for r in rows]
    if target != "trn2":
        lines.append(f"SKIPPED for lack of a `neuron` device: the device count, the op on `neuron`, the "
                     f"{COLLECTIVE_RANKS}-rank `neuron` all-reduce and the rope_hf kernel at LNC={lnc}. Ran on the CPU "
                     f"instead: the op, a {COLLECTIVE_RANKS}-rank gloo all-reduce, the RoPE op's reference dispatch.")
    return "\n".join(lines)
