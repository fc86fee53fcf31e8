"""The trn2 plan rehearsed on CPU: configs/trn2.toml's plan on configs/cpu.toml's workload.

Both files are read when a rehearsal is resolved, never copied. From cpu.toml come only the
WORKLOAD keys — what data and how much of it — so a rehearsed run's step 1 sees exactly the batch
of the plain CPU run; every other key (tensor/sequence/data parallelism, activation checkpointing,
dtype, compile, optimizer, NKI choices, …) is trn2.toml's, [paths.<path>] tables included. Then
what a CPU machine cannot do as trn2 does is replaced, each in one place with its reason:
the world size (TP × the plain run's data-parallel degree, one node), the TP degree where the
model's heads cannot be split as planned, and the settings in CPU_SUBSTITUTES. The target is `cpu`
(device cpu, gloo collectives); on it the nki path runs each kernel's PyTorch reference.

`check_plan` reads what every rank recorded (pipeline.titan.plan_probe) and says, check by check,
whether the plan really ran: DTensor parameters on the (dp_shard, tp) mesh with the planned TP
placements, FSDP's bf16 compute and fp32 reduction, activation checkpointing on every block,
sequence shards between blocks and full sequences inside attention, collectives on the tp group.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, replace

from pipeline.checkpoint.arch import Qwen3Arch
from pipeline.errors import Check, PipelineError
from pipeline.models import registry
from pipeline.run import settings as settings_mod
from pipeline.run.settings import TrainSettings

PLAN_TARGET = "trn2"  # the plan rehearsed
HOST_TARGET = "cpu"  # where it is rehearsed, and the plain run it is compared with
STEPS = 2  # step 1 is compared with the plain run; step 2 shows the sharded optimizer step worked
# The workload: which batches, how many steps, when to save. Taken from the plain CPU run so the
# rehearsal's step-1 batch is the plain run's (same data, batch size, sequence length and order).
WORKLOAD = settings_mod.named("workload")  # their fields say `workload` (pipeline.run.settings)
# trn2 values a CPU cannot run → what runs instead, and why. Only applied where trn2.toml asks for them.
CPU_SUBSTITUTES = {
    "compile_backend": {
        "neuron": ("aot_eager", "the neuron backend lowers to neuronx-cc and runs only on Trainium; aot_eager runs "
                   "the same Dynamo + AOTAutograd front end on CPU (neuron:torch/compile/about-torch-compile.html: "
                   "Dynamo → AOTAutograd → StableHLO → neuronx-cc; docs/sources.md)"),
    },
}


@dataclass(frozen=True)
class Difference:
    """One place where the rehearsal does not run trn2.toml's value, and why."""

    key: str
    planned: object
    rehearsed: object
    reason: str


@dataclass(frozen=True)
class Rehearsal:
    settings: TrainSettings
    differences: list[Difference]


def _settings_for(target: str, path: str) -> TrainSettings:
    return settings_mod.load(target, path, registry.names())


def data_parallel_degree(settings: TrainSettings) -> int:
    return settings.world_size // settings.tensor_parallel


def tensor_parallel_degree(planned: int, arch: Qwen3Arch) -> int:
    """The planned TP degree where the heads allow it, else the largest smaller one that divides
    them; at least 2, or there is no tensor parallelism to rehearse."""
    for degree in range(max(planned, 2), 1, -1):
        if arch.num_attention_heads % degree == 0 and arch.num_key_value_heads % degree == 0:
            return degree
    raise PipelineError(f"the model's heads ({arch.num_attention_heads}, {arch.num_key_value_heads} kv) cannot be "
                        "split over 2 tensor-parallel ranks, so the TP plan cannot be rehearsed on it.",
                        "rehearse a model whose head counts are even (tiny, tiny-moe).")


def plan(path: str, arch: Qwen3Arch, steps: int = STEPS) -> Rehearsal:
    """trn2.toml's settings for `path`, rehearsable on this CPU, with every difference named."""
    planned, host = _settings_for(PLAN_TARGET, path), _settings_for(HOST_TARGET, path)
    differences = []
    changes = {}
    for key in WORKLOAD:
        value = steps if key == "steps" else getattr(host, key)
        changes[key] = value
        if value != getattr(planned, key):
            differences.append(Difference(key, getattr(planned, key), value,
                                          f"workload of the plain CPU run ({HOST_TARGET}.toml), so step 1 sees its batch"
                                          if key != "steps" else "a rehearsal: step 1 is compared, step 2 updates"))
    tp = tensor_parallel_degree(planned.tensor_parallel, arch)
    if tp != planned.tensor_parallel:
        differences.append(Difference("tensor_parallel", planned.tensor_parallel, tp,
                                      f"the largest degree ≤ the plan (at least 2) that divides the model's "
                                      f"{arch.num_attention_heads} heads and {arch.num_key_value_heads} kv heads"))
    dp = data_parallel_degree(host)
    world = {"nproc_per_node": tp * dp, "nnodes": 1}
    for key, value in world.items():
        if value != getattr(planned, key):
            differences.append(Difference(key, getattr(planned, key), value,
                                          f"world size: TP {tp} × the plain CPU run's {dp} data-parallel ranks, on this machine"))
    changes |= {"tensor_parallel": tp, **world}
    for key, substitutes in CPU_SUBSTITUTES.items():
        value = getattr(planned, key)
        if value in substitutes and _in_effect(planned, key):
            changes[key], reason = substitutes[value]
            differences.append(Difference(key, value, changes[key], reason))
    if planned.data_parallel_shard not in (-1, dp):
        changes["data_parallel_shard"] = -1
        differences.append(Difference("data_parallel_shard", planned.data_parallel_shard, -1,
                                      "FSDP over the rehearsal's remaining ranks"))
    if planned.export_dtype != "float32":
        changes["export_dtype"] = "float32"
        differences.append(Difference("export_dtype", planned.export_dtype, "float32",
                                      "a 2-step plan at trn2's lr moves weights below bfloat16's resolution: the "
                                      "export verify compares with the plain run is float32"))
    differences.append(Difference("target", PLAN_TARGET, HOST_TARGET,
                                  "no Trainium here: device cpu, gloo collectives; the nki path runs each kernel's "
                                  "PyTorch reference (nki and nkilib import only on Neuron)"))
    return Rehearsal(replace(planned, **changes), differences)


def _in_effect(settings: TrainSettings, key: str) -> bool:
    return settings.compile if key == "compile_backend" else True


def _sharded(placement: str) -> bool:
    return placement.startswith(("S(", "_S("))


def _seq(record: dict, module: str, io: str = "input") -> int | None:
    """The local tokens of the activation `module` took in or gave out on this rank: every dim but the
    feature dim, so [B, L, D] on torchtitan 0.3.0 and [T, D] packed tokens on main count alike (titan.api)."""
    seen = record["step"]["modules"].get(module, {}).get(io)
    return math.prod(seen["local_shape"][:-1]) if seen and len(seen["local_shape"]) > 1 else None


def check_plan(settings: TrainSettings, arch: Qwen3Arch, landmarks: registry.PlanLandmarks,
               records: list[dict]) -> list[Check]:
    """Whether every rank ran the plan in `settings`, from its plan/rank<N>.json."""
    checks: list[Check] = []
    tp, world, seq = settings.tensor_parallel, settings.world_size, settings.seq_len * settings.local_batch_size
    if len(records) != world:
        return [Check("ranks", False, f"{len(records)} plan records for {world} ranks")]

    coords = {(r["mesh"]["dims"]["dp_shard"]["coordinate"], r["mesh"]["dims"]["tp"]["coordinate"]) for r in records}
    sizes = {(r["mesh"]["dims"]["dp_shard"]["size"], r["mesh"]["dims"]["tp"]["size"]) for r in records}
    checks.append(Check("mesh", sizes == {(world // tp, tp)} and len(coords) == world,
                        f"(dp_shard, tp) sizes {sorted(sizes)}, expected ({world // tp}, {tp}); "
                        f"{len(coords)} distinct coordinates over {world} ranks"))

    layout_problems, counts = [], {"dp_shard × tp (tp sharded)": 0, "dp_shard × tp (tp replicated)": 0,
                                   "dp_shard only": 0}
    for r in records:
        for name, p in r["layout"]["parameters"].items():
            mesh, placements = p.get("mesh", []), p.get("placements", [])
            if p["kind"] != "DTensor" or "dp_shard" not in mesh or not _sharded(placements[mesh.index("dp_shard")]):
                layout_problems.append(f"rank {r['mesh']['rank']} {name}: {p['kind']} {mesh} {placements} (not FSDP-sharded)")
                continue
            if r["mesh"]["rank"] == 0:
                key = ("dp_shard only" if "tp" not in mesh else
                       "dp_shard × tp (tp sharded)" if _sharded(placements[mesh.index("tp")]) else "dp_shard × tp (tp replicated)")
                counts[key] += 1
        for name, expected in ((landmarks.colwise, "S(0)"), (landmarks.rowwise, "S(1)")):
            p = r["layout"]["parameters"].get(name)
            got = p and p.get("mesh") == ["dp_shard", "tp"] and p["placements"][1] == expected
            if not got:
                layout_problems.append(f"rank {r['mesh']['rank']} {name}: {p and (p.get('mesh'), p.get('placements'))}, "
                                       f"expected Shard on dp_shard and {expected} on tp")
    checks.append(Check("fsdp × tp layout", not layout_problems,
                        "; ".join(layout_problems[:3]) if layout_problems else
                        f"every parameter a DTensor FSDP-sharded over dp_shard; {landmarks.colwise} S(0) and "
                        f"{landmarks.rowwise} S(1) on tp; parameters: "
                        + ", ".join(f"{v} {k}" for k, v in counts.items())))

    compute = {m["param_dtype"] for r in records for m in r["layout"]["fsdp"].values()}
    reduce = {m["reduce_dtype"] for r in records for m in r["layout"]["fsdp"].values()}
    master = {p["dtype"] for r in records for p in r["layout"]["parameters"].values()}
    weight_module = landmarks.head  # outside the blocks: hooked also when the blocks are compiled
    in_forward = {r["step"]["modules"].get(weight_module, {}).get("weight_dtype") for r in records}
    checks.append(Check("mixed precision", compute == {settings.dtype} and reduce == {"float32"} and
                        master == {"float32"} and in_forward == {settings.dtype},
                        f"FSDP param_dtype {sorted(compute)}, reduce_dtype {sorted(reduce)}; sharded parameters "
                        f"{sorted(master)}; {weight_module}'s weight while it ran {sorted(map(str, in_forward))}; "
                        f"planned {settings.dtype} compute, float32 reduction and master weights"))

    blocks = {f"{landmarks.block.rsplit('.', 1)[0]}.{i}" for i in range(arch.num_hidden_layers)}
    wrapped = {name for r in records for name in r["layout"]["activation_checkpointed"]}
    want = blocks if settings.activation_checkpoint != "none" else set()
    checks.append(Check("activation checkpointing", wrapped == want,
                        f"{settings.activation_checkpoint}: checkpoint-wrapped {sorted(wrapped) or 'none'}"))

    compiled = {name for r in records for name in r["layout"]["compiled"]}
    checks.append(Check("compile", compiled == (blocks if settings.compile else set()),
                        f"compile={settings.compile} ({settings.compile_backend}): compiled {sorted(compiled) or 'none'}"))

    # Sequence shards (in tokens: local batch × seq_len): between blocks the residual stream holds seq/tp per rank under SP
    # (the full seq without); attention and the output projection see the full sequence. Modules
    # inside compiled blocks are not hooked (see plan_probe), so there only the model's ends show.
    local = seq // tp if settings.sequence_parallel else seq
    expected = {(landmarks.embedding, "output"): local, (landmarks.head, "input"): seq,
                (landmarks.block, "input"): local, (landmarks.norm, "input"): local,
                (landmarks.attention_input, "input"): seq}
    hooked_everywhere = not any(r["layout"]["compiled"] for r in records)
    if not hooked_everywhere:
        expected = {k: v for k, v in expected.items() if k[0] in (landmarks.embedding, landmarks.head)}
    seen = {k: sorted({_seq(r, *k) for r in records}, key=str) for k in expected}
    shapes_ok = all(v == [expected[k]] for k, v in seen.items())
    tp_comms = [(r["step"]["collectives"] or {}).get("tp", {}) if r["step"]["collectives"] is not None else None
                for r in records]
    if any(c is None for c in tp_comms):
        comms_ok, comms_text = not hooked_everywhere, "collectives not counted (compiled blocks)"
    elif settings.sequence_parallel:
        comms_ok = all(c.get("all_gather", 0) > 0 and c.get("reduce_scatter", 0) > 0 for c in tp_comms)
        comms_text = f"step-1 collectives on tp {tp_comms[0]} (rank 0), expected all-gathers and reduce-scatters"
    else:
        comms_ok = all(c.get("all_reduce", 0) > 0 and not c.get("reduce_scatter") for c in tp_comms)
        comms_text = f"step-1 collectives on tp {tp_comms[0]} (rank 0), expected all-reduces and no reduce-scatter"
    checks.append(Check("sequence parallel" if settings.sequence_parallel else "tensor parallel activations",
                        shapes_ok and comms_ok,
                        "local tokens: " + ", ".join(f"{m} {io} {'/'.join(map(str, v))}" for (m, io), v in seen.items())
                        + f" (expected {local} between blocks, {seq} in attention and the head); {comms_text}"))
    return checks
