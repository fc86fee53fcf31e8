"""The NKI-side glue (pipeline.models.nki.neuron_kernels, kernels) against a stand-in of the documented
NKI 0.7 API (tests/nki_stand_in.py: the decorator's signature, the nesting rule, what wrap_nki reads),
with stand-ins of nki-library's kernels jitted the way nki-library jits them, since the real packages
import only in the Neuron image. Launching a kernel specializes it for real: its function runs and every
nested kernel it calls is checked. The real kernels are checked in tests/models/test_models_nki_ops.py
where nki imports (skipped otherwise)."""

import enum
import importlib
import inspect
import sys
import types
from dataclasses import dataclass

import pytest

import nki_stand_in as nki
from pipeline.models.nki import kernels


class RouterActFnType(enum.Enum):
    SOFTMAX = 0
    SIGMOID = 1


class MoECTEImplementation(enum.Enum):
    shard_on_block = 0
    shard_on_i = 1


@dataclass
class MoECTESpec:
    implementation: MoECTEImplementation


# nki-library's kernels with a config of their own, other than the pipeline's bare `@nki.jit`: which
# config the 2.33 nki-library gives them is not known, so the entry points must not depend on it.
LIBRARY_CONFIG = {"compile_config": nki.CompileConfig(non_ssa_legalization=True)}
ENTRY_PACKAGE = "pipeline.models.nki.neuron_kernels"


@pytest.fixture
def stand_ins(monkeypatch):
    record = {}

    def router_topk(x, w, w_bias, router_logits, expert_affinities, expert_index, act_fn, k, x_hbm_layout,
                    x_sb_layout, router_pre_norm=True, norm_topk_prob=False, shard_on_tokens=False, **rest):
        record["router_topk"] = dict(locals())

    @nki.jit(**LIBRARY_CONFIG)
    def moe_cte(*args, **kwargs):
        record["moe_cte"] = (args, kwargs)
        return "moe output"

    @nki.jit(**LIBRARY_CONFIG)
    def rope_hf(q, k, q_out, k_out, rope_cache=None, backward=False):
        record["rope_hf"] = rope_cache
        return q_out, k_out

    library = {
        "nkilib": types.ModuleType("nkilib"),
        "nkilib.core.embeddings.rope_hf": types.SimpleNamespace(rope_hf=rope_hf),
        "nkilib.core.moe.moe_cte.moe_cte": types.SimpleNamespace(
            MoECTEImplementation=MoECTEImplementation, MoECTESpec=MoECTESpec, moe_cte=moe_cte),
        "nkilib.core.router_topk.router_topk": types.SimpleNamespace(router_topk=router_topk),
        "nkilib.core.utils.common_types": types.SimpleNamespace(RouterActFnType=RouterActFnType),
    }
    for name, module in {**nki.modules(record), **library}.items():
        monkeypatch.setitem(sys.modules, name, module)
    _forget_entry_modules()
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    kernels._wrapped.cache_clear()
    yield record
    kernels._wrapped.cache_clear()
    _forget_entry_modules()


def _forget_entry_modules():
    """The entry modules are imported afresh against each test's stand-ins (also off their parent package,
    whose attribute `from … import` would otherwise find)."""
    for name in [m for m in sys.modules if m == ENTRY_PACKAGE or m.startswith(ENTRY_PACKAGE + ".")]:
        del sys.modules[name]
    parent = sys.modules.get(ENTRY_PACKAGE.rpartition(".")[0])
    if parent is not None and hasattr(parent, "neuron_kernels"):
        delattr(parent, "neuron_kernels")


def test_the_stand_in_enforces_the_documented_rules():
    """So the tests below can fail: keyword-only configs, and a nested kernel of another config raises
    unless the top-level kernel allows the override."""
    with pytest.raises(TypeError):
        nki.jit(lambda x: x, nki.CompileConfig())  # compile_config is keyword-only
    inner = nki.jit(lambda x: x + 1, compile_config=nki.CompileConfig(barrier_check=True))
    with pytest.raises(nki.NestedConfigError, match="nested @nki.jit kernel"):
        nki.jit(lambda x: inner(x))(1)
    assert nki.jit(lambda x: nki.jit(lambda y: y * 2)(x))(3) == 6  # the same config nests
    allowing = nki.jit(lambda x: inner(x),
                       specialization_config=nki.SpecializationConfig(allow_nested_config_override=True))
    with pytest.warns(UserWarning, match="inlined"):
        assert allowing(1) == 2
    assert inner(1) == 2  # on its own it is the top-level kernel


def test_rope_hf_goes_to_wrap_nki_as_nki_library_jitted_it(stand_ins):
    q_out, k_out = kernels.launch("rope_hf")("q", "k", "q_out", "k_out", rope_cache="cache", backward=False)
    assert (q_out, k_out) == ("q_out", "k_out") and stand_ins["rope_hf"] == "cache"
    assert stand_ins["wrapped"] == ["rope_hf"] and stand_ins["grids"] == [(2,)]


def test_router_topk_is_jitted_through_a_wrapper_that_allocates_its_outputs(stand_ins):
    returned = kernels.launch("router_topk_kernel")(nki.Array((2048, 512), "bfloat16"),
                                                    nki.Array((512, 64), "bfloat16"), 8, True)
    got = stand_ins["router_topk"]
    # every buffer the wrapper allocates is an output router_topk writes, and all of them are
    # returned, in router_topk's own order (issue 17, 3.2: the affinities were allocated, not returned)
    logits, index, affinities = returned
    assert got["router_logits"] is logits and got["expert_index"] is index and got["expert_affinities"] is affinities
    assert sorted(map(id, stand_ins["allocated"])) == sorted(map(id, returned))
    assert (logits.shape, logits.dtype, logits.buffer) == ((2048, 64), "float32", "shared_hbm")
    assert (index.shape, index.dtype) == ((2048, 8), "uint32")  # the kernel's index dtype, as in nki-library's test
    assert (affinities.shape, affinities.dtype) == ((2048, 64), "bfloat16") and got["w_bias"] is None
    assert got["act_fn"] is RouterActFnType.SOFTMAX and got["k"] == 8 and got["router_pre_norm"]
    assert got["x_hbm_layout"] == 1 and got["shard_on_tokens"]  # x as [T, H]; tokens split over LNC=2


def test_moe_cte_runs_under_one_jit_with_its_spec_built_inside(stand_ins):
    """moe_cte is already jitted by nki-library: the entry point calls its function inside the one jit of
    ours, so no nested kernel of another config is specialized (a second jit around it raised here)."""
    assert kernels.launch("moe_cte_shard_on_i")("h", "a", "gu", "d", "tpid", "b2e", 256) == "moe output"
    args, kwargs = stand_ins["moe_cte"]
    assert args[:7] == ("h", "a", "gu", "d", "tpid", "b2e", 256)
    assert args[7] == MoECTESpec(MoECTEImplementation.shard_on_i) and kwargs == {"is_tensor_update_accumulating": True}
    entry = importlib.import_module(f"{ENTRY_PACKAGE}.moe").moe_cte_shard_on_i
    assert isinstance(entry, nki.Kernel)  # wrap_nki needs a jitted kernel: tensors and ints only
    assert all(p.default is inspect.Parameter.empty for p in entry.sign.parameters.values())


def test_a_failing_moe_kernel_never_breaks_rope(stand_ins, monkeypatch):
    """One import per kernel: nki-library's MoE module failing to import stops the MoE override alone."""
    monkeypatch.setitem(sys.modules, "nkilib.core.moe.moe_cte.moe_cte", None)  # its import raises ImportError
    q_out, _ = kernels.launch("rope_hf")("q", "k", "q_out", "k_out", rope_cache="cache", backward=False)
    assert q_out == "q_out"
    assert kernels.launch("router_topk_kernel") is not None
    with pytest.raises(kernels.KernelUnavailable, match=r"moe_cte_shard_on_i cannot be loaded .*not affected") as err:
        kernels.launch("moe_cte_shard_on_i")
    assert "nki_overrides" in err.value.fix


def test_launch_wraps_jitted_kernels_with_a_tuple_grid(stand_ins):
    for name in ("rope_hf", "router_topk_kernel", "moe_cte_shard_on_i"):
        kernels.launch(name)
    assert stand_ins["wrapped"] == ["rope_hf", "router_topk_kernel", "moe_cte_shard_on_i"]
    assert stand_ins["grids"] == [(2,), (2,), (2,)]


def test_verify_kernels_fails_the_row_of_a_kernel_that_cannot_load_and_checks_the_rest():
    import torch

    from pipeline.models.nki.kernel_check import Case, table, verify

    def replacement(name):
        def run(inputs, dtype, device, use_nki):
            if name == "moe_cte":
                raise kernels.KernelUnavailable("NKI kernel moe_cte_shard_on_i cannot be loaded (stand-in).")
            return {"out": inputs["x"].to(dtype)}
        return run

    cases = [Case(f"nki_{n}", n, "S4", "itself", lambda seed: {"x": torch.ones(4)}, replacement(n),
                  lambda inputs: {"out": inputs["x"]}, {}) for n in ("rope_hf", "moe_cte")]
    rows = verify(cases, ["float32"], device="cpu", use_nki=True)
    assert [(r["override"], r["pass"]) for r in rows] == [("nki_rope_hf", True), ("nki_moe_cte", False)]
    assert "moe_cte_shard_on_i cannot be loaded" in table(rows)
