"""What one rank really runs, recorded from the live model: its parallel layout and one step.

- layout: the device mesh, every parameter (plain tensor or DTensor: mesh dims, placements, global
  and local shape, dtype), FSDP's mixed-precision policy per sharded module, which modules are
  activation-checkpointed and which are compiled, and every module's class.
- step: over one training step (forward, backward, optimizer), the local shape and layout of the
  first input and output of every module that ran, the dtype of its weight while it ran (FSDP's
  compute dtype), and every collective issued, counted per kind and per mesh dimension.

PipelineTrainer writes it to <run dir>/plan/rank<N>.json when the run asks for it (the rehearsal
does), so a test can assert the plan ran instead of inferring it from matching losses.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

# Wrappers that activation checkpointing, torch.compile and FSDP put into module names.
WRAPPER_PARTS = ("_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module")
# c10d / functional-collective op names → one kind each.
COLLECTIVE_KINDS = {
    "allgather": "all_gather", "_allgather_base": "all_gather", "allgather_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "reduce_scatter": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter", "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "allreduce": "all_reduce", "allreduce_coalesced": "all_reduce", "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "alltoall": "all_to_all", "alltoall_base": "all_to_all", "all_to_all_single": "all_to_all",
    "broadcast": "broadcast", "barrier": "barrier",
}
COLLECTIVE_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional", "_c10d_functional_autograd")


def canonical(name: str) -> str:
    """A module/parameter name without the wrappers' parts: what the model itself calls it."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_PARTS)


def describe(value) -> dict | None:
    if isinstance(value, DTensor):
        return {"kind": "DTensor", "mesh": list(value.device_mesh.mesh_dim_names or ()),
                "placements": [str(p) for p in value.placements], "shape": list(value.shape),
                "local_shape": list(value.to_local().shape), "dtype": str(value.dtype).removeprefix("torch.")}
    if isinstance(value, torch.Tensor):
        return {"kind": "Tensor", "shape": list(value.shape), "local_shape": list(value.shape),
                "dtype": str(value.dtype).removeprefix("torch.")}
    return None


def _first_tensor(value):
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        for item in value:
            found = _first_tensor(item)
            if found is not None:
                return found
    return None


def group_labels(parallel_dims) -> dict[tuple[int, ...], str]:
    """A group's ranks → the mesh dimensions whose group (on this rank) has exactly those ranks.

    By ranks, not by group object: torchtitan builds several meshes over the same axes (the
    data-loading mesh, FSDP's mesh, the spmd_types mesh), each with its own process groups."""
    from torch.distributed import get_process_group_ranks

    labels: dict[tuple[int, ...], list[str]] = defaultdict(list)
    for dim, mesh in parallel_dims.get_all_one_dimensional_meshes().items():
        labels[tuple(sorted(get_process_group_ranks(mesh.get_group())))].append(dim)
    labels[tuple(range(torch.distributed.get_world_size()))].append("world")
    return {ranks: "+".join(sorted(dims)) for ranks, dims in labels.items()}


def _label(group_name: str | None, labels: dict[tuple[int, ...], str]) -> str:
    from torch.distributed import get_process_group_ranks
    from torch.distributed.distributed_c10d import _resolve_process_group

    if group_name is None:
        return "unknown group"
    ranks = tuple(sorted(get_process_group_ranks(_resolve_process_group(group_name))))
    return labels.get(ranks, f"ranks {list(ranks)}")


def mesh_record(parallel_dims) -> dict:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    dims = {dim: {"size": mesh.size(), "coordinate": mesh.get_local_rank()}
            for dim, mesh in parallel_dims.get_all_one_dimensional_meshes().items()}
    return {"world_size": parallel_dims.world_size, "rank": rank, "dims": dims}


def layout(model: torch.nn.Module) -> dict:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    parameters = {canonical(name): describe(p) for name, p in model.named_parameters()}
    fsdp, checkpointed, compiled, classes = {}, [], [], {}
    for name, module in model.named_modules():
        name = canonical(name) or "<root>"
        classes.setdefault(name, type(module).__name__)
        if hasattr(module, "_get_fsdp_state"):
            policy = module._get_fsdp_state()._mp_policy
            fsdp[name] = {"param_dtype": str(policy.param_dtype).removeprefix("torch."),
                          "reduce_dtype": str(policy.reduce_dtype).removeprefix("torch.")}
        if isinstance(module, CheckpointWrapper):
            checkpointed.append(name)
        if getattr(module, "_compiled_call_impl", None) is not None or type(module).__name__ == "OptimizedModule":
            compiled.append(name)
    return {"parameters": parameters, "fsdp": fsdp, "activation_checkpointed": checkpointed, "compiled": compiled,
            "modules": classes}


def _group_name(namespace: str, args) -> str | None:
    if namespace != "c10d":
        names = [a for a in args if isinstance(a, str)]
        return names[-1] if names else None  # functional collectives: (…, reduce op, group name)
    for arg in args:  # c10d ops take the ProcessGroup as a TorchScript object
        if isinstance(arg, torch.ScriptObject) and arg._type().qualified_name().endswith("c10d.ProcessGroup"):
            return torch.distributed.ProcessGroup.unbox(arg).group_name
    return None


class CollectiveCounter(TorchDispatchMode):
    """Counts every collective op dispatched while active, by kind and by mesh dimension."""

    def __init__(self, labels: dict[tuple[int, ...], str]):
        super().__init__()
        self.labels = labels
        self.counts: dict[str | None, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        namespace, _, op = func._schema.name.partition("::")
        kind = COLLECTIVE_KINDS.get(op.rstrip("_")) if namespace in COLLECTIVE_NAMESPACES else None
        if kind is not None:
            self.counts[_group_name(namespace, list(args) + list((kwargs or {}).values()))][kind] += 1
        return func(*args, **(kwargs or {}))

    def record(self) -> dict:
        """{mesh dimension(s): {kind: count}}, groups over the same ranks added together."""
        out: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))
        for group, kinds in self.counts.items():
            for kind, count in kinds.items():
                out[_label(group, self.labels)][kind] += count
        return {label: dict(kinds) for label, kinds in sorted(out.items())}


class StepProbe:
    """Records one training step: module inputs/outputs (first call of each) and collectives."""

    def __init__(self, model: torch.nn.Module, labels: dict[tuple[int, ...], str], compiled: list[str] = ()):
        self.model = model
        # Compiled modules (fullgraph) would have to trace the hooks: leave them and their insides out.
        # And Dynamo compiles nothing while a dispatch mode is active: with compiled modules the
        # collectives are not counted (the record says so) rather than the run failing.
        self.skip = tuple(compiled)
        self.counter = CollectiveCounter(labels) if not self.skip else None
        self.modules: dict[str, dict] = {}
        self.handles = []

    def _pre(self, name):
        def hook(module, args, kwargs):
            if name in self.modules:
                return  # activation checkpointing runs the forward again in backward
            weight = getattr(module, "weight", None)
            self.modules[name] = {"class": type(module).__name__, "input": describe(_first_tensor((args, kwargs))),
                                  "weight_dtype": str(weight.dtype).removeprefix("torch.")
                                  if isinstance(weight, torch.Tensor) else None}
        return hook

    def _post(self, name):
        def hook(module, args, kwargs, output):
            entry = self.modules.get(name)
            if entry is not None and "output" not in entry:
                entry["output"] = describe(_first_tensor(output))
        return hook

    def __enter__(self) -> "StepProbe":
        for name, module in self.model.named_modules():
            name = canonical(name) or "<root>"
            if name == "<root>" or type(module).__name__ in ("CheckpointWrapper", "OptimizedModule"):
                continue
            if any(name == s or name.startswith(s + ".") for s in self.skip):
                continue
            self.handles.append(module.register_forward_pre_hook(self._pre(name), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(name), with_kwargs=True))
        if self.counter is not None:
            self.counter.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self.counter is not None:
            self.counter.__exit__(*exc)
        for handle in self.handles:
            handle.remove()

    def record(self) -> dict:
        return {"modules": self.modules, "collectives": self.counter.record() if self.counter is not None else None,
                "not_hooked": list(self.skip)}


def write(path: Path, record: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.replace(path)
