"""The NKI-side glue (pipeline.models.nki.neuron_kernels, kernels) against stand-ins of the documented
nki / nkilib / torch_neuronx APIs, since the real packages import only in the Neuron image: every
entry handed to wrap_nki is an nki.jit kernel (wrap_nki reads its `.sign` and `.func`), router_topk
is called the way nki-library's own test calls it, moe_cte gets its spec built inside the trace, and
launches use a tuple grid. The real kernels are checked in tests/models/test_models_nki_ops.py where nki
imports (skipped otherwise)."""

import enum
import importlib
import inspect
import sys
import types
from dataclasses import dataclass

import pytest

from pipeline.models.nki import kernels


class Kernel:
    """What nki.jit returns, as far as torch_neuronx's wrap_nki uses it (nki_hop.py)."""

    def __init__(self, func, **options):
        self.func, self.sign, self.options = func, inspect.signature(func), options


def jit(fn=None, **options):
    return Kernel(fn, **options) if fn is not None else (lambda f: Kernel(f, **options))


@dataclass
class Array:
    shape: tuple
    dtype: str
    buffer: str = "hbm"


class RouterActFnType(enum.Enum):
    SOFTMAX = 0
    SIGMOID = 1


class MoECTEImplementation(enum.Enum):
    shard_on_block = 0
    shard_on_i = 1


@dataclass
class MoECTESpec:
    implementation: MoECTEImplementation


@pytest.fixture
def nki_stand_ins(monkeypatch):
    calls = {}

    def router_topk(x, w, w_bias, router_logits, expert_affinities, expert_index, act_fn, k, x_hbm_layout,
                    x_sb_layout, router_pre_norm=True, norm_topk_prob=False, shard_on_tokens=False, **rest):
        calls["router_topk"] = dict(locals())

    def moe_cte(*args, **kwargs):
        calls["moe_cte"] = (args, kwargs)
        return "moe output"

    def wrap_nki(kernel):
        _sign, func = kernel.sign, kernel.func  # what the real wrap_nki reads: a plain function has neither
        calls.setdefault("wrapped", []).append(func.__name__)

        class Caller:
            def __getitem__(self, grid):
                calls.setdefault("grids", []).append(tuple(map(int, grid)))  # as one nki_hop.py does
                return lambda *a, **kw: None
        return Caller()

    def ndarray(shape, dtype, buffer):
        array = Array(tuple(shape), dtype, buffer)
        calls.setdefault("allocated", []).append(array)
        return array

    language = types.SimpleNamespace(ndarray=ndarray,
                                     float32="float32", uint32="uint32", shared_hbm="shared_hbm")
    modules = {
        "nki": types.SimpleNamespace(jit=jit, language=language),
        "nki.language": language,
        "torch_neuronx": types.SimpleNamespace(wrap_nki=wrap_nki),
        "nkilib": types.ModuleType("nkilib"),
        "nkilib.core.embeddings.rope_hf": types.SimpleNamespace(rope_hf=jit(lambda q, k, q_out, k_out: None)),
        "nkilib.core.moe.moe_cte.moe_cte": types.SimpleNamespace(
            MoECTEImplementation=MoECTEImplementation, MoECTESpec=MoECTESpec, moe_cte=moe_cte),
        "nkilib.core.router_topk.router_topk": types.SimpleNamespace(router_topk=router_topk),
        "nkilib.core.utils.common_types": types.SimpleNamespace(RouterActFnType=RouterActFnType),
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.delitem(sys.modules, "pipeline.models.nki.neuron_kernels", raising=False)
    kernels._wrapped.cache_clear()
    yield importlib.import_module("pipeline.models.nki.neuron_kernels"), calls
    kernels._wrapped.cache_clear()
    sys.modules.pop("pipeline.models.nki.neuron_kernels", None)


def test_router_topk_is_jitted_through_a_wrapper_that_allocates_its_outputs(nki_stand_ins):
    neuron_kernels, calls = nki_stand_ins
    entry = neuron_kernels.router_topk_kernel
    assert isinstance(entry, Kernel)  # nki-library's router_topk is a plain function; wrap_nki needs nki.jit
    returned = entry.func(Array((2048, 512), "bfloat16"), Array((512, 64), "bfloat16"), 8, True)
    got = calls["router_topk"]
    # every buffer the wrapper allocates is an output router_topk writes, and all of them are
    # returned, in router_topk's own order (issue 17, 3.2: the affinities were allocated, not returned)
    logits, index, affinities = returned
    assert got["router_logits"] is logits and got["expert_index"] is index and got["expert_affinities"] is affinities
    assert sorted(map(id, calls["allocated"])) == sorted(map(id, returned))
    assert (logits.shape, logits.dtype, logits.buffer) == ((2048, 64), "float32", "shared_hbm")
    assert (index.shape, index.dtype) == ((2048, 8), "uint32")  # the kernel's index dtype, as in nki-library's test
    assert (affinities.shape, affinities.dtype) == ((2048, 64), "bfloat16") and got["w_bias"] is None
    assert got["act_fn"] is RouterActFnType.SOFTMAX and got["k"] == 8 and got["router_pre_norm"]
    assert got["x_hbm_layout"] == 1 and got["shard_on_tokens"]  # x as [T, H]; tokens split over LNC=2


def test_moe_cte_gets_its_spec_inside_the_trace(nki_stand_ins):
    neuron_kernels, calls = nki_stand_ins
    entry = neuron_kernels.moe_cte_shard_on_i
    assert isinstance(entry, Kernel) and entry.options == {"mode": "trace"}  # as moe_cte itself is jitted
    assert all(p.default is inspect.Parameter.empty for p in entry.sign.parameters.values())  # tensors and ints only
    assert entry.func("h", "a", "gu", "d", "tpid", "b2e", 256) == "moe output"
    args, kwargs = calls["moe_cte"]
    assert args[:7] == ("h", "a", "gu", "d", "tpid", "b2e", 256)
    assert args[7] == MoECTESpec(MoECTEImplementation.shard_on_i) and kwargs == {"is_tensor_update_accumulating": True}


def test_launch_wraps_jitted_kernels_with_a_tuple_grid(nki_stand_ins, monkeypatch):
    _, calls = nki_stand_ins
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    for name in ("rope_hf", "router_topk_kernel", "moe_cte_shard_on_i"):
        kernels.launch(name)
    assert calls["wrapped"] == ["<lambda>", "router_topk_kernel", "moe_cte_shard_on_i"]
    assert calls["grids"] == [(2,), (2,), (2,)]
