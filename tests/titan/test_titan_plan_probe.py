"""pipeline.titan.plan_probe in one process (a gloo world of 1): names without wrappers, tensors and
DTensors described by mesh and placements, collectives counted by kind and labelled by the mesh
dimension whose ranks they ran on, module inputs/outputs recorded once per step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from pipeline.titan import plan_probe


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    store = dist.FileStore(str(tmp_path_factory.mktemp("store") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_canonical_drops_wrapper_parts():
    name = "layers.0._checkpoint_wrapped_module._orig_mod.attention.wo.weight"
    assert plan_probe.canonical(name) == "layers.0.attention.wo.weight"


def test_describe_dtensor_and_tensor(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
    d = plan_probe.describe(distribute_tensor(torch.zeros(4, 6), mesh, [Shard(1)]))
    assert d == {"kind": "DTensor", "mesh": ["tp"], "placements": ["S(1)"], "shape": [4, 6], "local_shape": [4, 6],
                 "dtype": "float32"}
    assert plan_probe.describe(torch.zeros(2, dtype=torch.bfloat16))["dtype"] == "bfloat16"
    assert plan_probe.describe("not a tensor") is None


def test_collectives_are_counted_by_kind_and_labelled_by_ranks(world):
    labels = {(0,): "tp+world"}
    counter = plan_probe.CollectiveCounter(labels)
    t = torch.ones(4)
    with counter:
        dist.all_reduce(t)  # c10d op: the group comes as a ProcessGroup object
        out = torch.empty(4)
        dist.all_gather_into_tensor(out, t)
        funcol.reduce_scatter_tensor(t, "sum", 0, dist.group.WORLD).wait()  # functional: the group by name
        torch.add(t, 1)  # not a collective
    assert counter.record() == {"tp+world": {"all_reduce": 1, "all_gather": 1, "reduce_scatter": 1}}


def test_step_probe_records_each_module_once_and_removes_its_hooks(world):
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    with plan_probe.StepProbe(model, {(0,): "world"}) as probe:
        model(torch.ones(7, 3))
        model(torch.ones(9, 3))  # a second call (e.g. a recompute) does not overwrite the first
    record = probe.record()
    assert record["modules"]["0"]["input"]["local_shape"] == [7, 3]
    assert record["modules"]["2"]["output"]["local_shape"] == [7, 2]
    assert record["modules"]["0"]["weight_dtype"] == "float32" and record["modules"]["1"]["weight_dtype"] is None
    assert record["collectives"] == {}
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks


def test_compiled_modules_are_not_hooked_and_collectives_not_counted(world):
    model = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.Sequential(torch.nn.Linear(5, 2)))
    with plan_probe.StepProbe(model, {}, compiled=["1"]) as probe:
        model(torch.ones(2, 3))
    record = probe.record()
    assert set(record["modules"]) == {"0"} and record["collectives"] is None and record["not_hooked"] == ["1"]
