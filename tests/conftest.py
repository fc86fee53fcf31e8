"""The fixtures and hooks the test modules share: the embedded checkpoints, made once per session,
runs with checkpoints for export and verify, and the tiers (`slow`). Plain helpers are in helpers.py."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from pipeline import envvars
from helpers import CONTAINER_TESTS, EXPORT_MODELS, EXPORT_NPROC, TRAINED_STEPS, copy_model, run_pipeline


# ---- session fixtures -------------------------------------------------------------------------

@pytest.fixture(scope="session", autouse=True)
def digest_key():
    """The DCP digest key of this session's saves (pipeline.run.digest_key), never the user's own: set in
    the environment every stage and rank of the tests inherits. Outside pytest's basetemp, which some tests use
    as a checkpoints root (the key must never lie under one)."""
    import tempfile

    from pipeline.run import digest_key as keys

    folder = Path(tempfile.mkdtemp(prefix="pipeline-test-digest-key-"))
    key = folder / "dcp-digest.key"
    os.environ[envvars.DIGEST_KEY] = str(key)
    # made now, as a user's first save makes it: a test that checks a recorded digest before any save of its
    # pytest-xdist worker finds the key (each worker has its own)
    keys.load(folder.parent / f"{folder.name}-guards-nothing", create=True)
    yield key
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="session")
def embedded_checkpoints(tmp_path_factory) -> Path:
    """A checkpoints root holding tiny and tiny-moe (downloaded = made) with their data, never written by a test
    (`checkpoints` links it into a root per module). PIPELINE_TEST_CHECKPOINTS names one made before (a session of
    its own). Otherwise the first pytest-xdist worker to ask makes it, under a lock, where every worker finds it."""
    if os.environ.get(envvars.TEST_CHECKPOINTS):
        return Path(os.environ[envvars.TEST_CHECKPOINTS])
    from filelock import FileLock

    base = tmp_path_factory.getbasetemp()
    shared = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    root, made = shared / "checkpoints", shared / "checkpoints.made"
    with FileLock(shared / "checkpoints.lock"):
        if not made.exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            for model in ("tiny", "tiny-moe"):
                run_pipeline("download", "--model", model, root=root)
                run_pipeline("data", "--model", model, root=root)
            made.touch()
    return root


@pytest.fixture(scope="module")
def checkpoints(embedded_checkpoints, tmp_path_factory) -> Path:
    """A checkpoints root per test module with both embedded models and their data linked in: the runs a module
    trains there are its own, so modules on different pytest-xdist workers never share a run directory."""
    root = tmp_path_factory.mktemp("checkpoints")
    for model in ("tiny", "tiny-moe"):
        copy_model(embedded_checkpoints, root, model, link=True)
    return root


@pytest.fixture(scope="module")
def tiny_root(checkpoints, tmp_path_factory) -> Path:
    """A checkpoints root per test module holding the session's embedded tiny and its data (linked: the
    model is made once per session; each module's runs stay its own)."""
    return copy_model(checkpoints, tmp_path_factory.mktemp("tiny-checkpoints"), "tiny", link=True)


@pytest.fixture(scope="session")
def export_runs(embedded_checkpoints, tmp_path_factory) -> Path:
    """A checkpoints root of its own (the shared one's source/ and data/ linked in) with, per model,
    a native run that ran STEPS=0 and then resumed to STEPS=2: its checkpoint/ keeps step-0 and step-2, each
    with its model saved in float32 (step-N/hf), so that exports compare exactly and bfloat16 ones are casts."""
    root = tmp_path_factory.getbasetemp() / "export-runs"
    shutil.rmtree(root, ignore_errors=True)
    for model in EXPORT_MODELS:
        copy_model(embedded_checkpoints, root, model, link=True)
        for steps in ("0", str(TRAINED_STEPS)):
            run_pipeline("train", "--model", model, "--path", "native", "--steps", steps,
                         "--nproc-per-node", EXPORT_NPROC[model], "--export-dtype", "float32", root=root)
    return root


# ---- pytest-xdist (`make test`): a module's tests run on one worker, so its module fixtures are made once; the
# modules that read export_runs (which write into its runs) share one worker, so its training runs are made once.
# pytest-xdist's own `--dist loadgroup` cannot say so under pytest 9 (it renames Node._nodeid, which pytest 9 no
# longer reads): the scheduler is xdist's LoadScopeScheduling with this grouping, through xdist's hook for it.
EXPORT_RUNS_READERS = {f"tests/{module}" for module in (
    "e2e/test_e2e_hostile_runs_and_roots.py", "e2e/test_e2e_hostile_saved_state.py", "outputs/test_outputs_export.py",
    "outputs/test_outputs_harness.py", "outputs/test_outputs_serve.py", "outputs/test_outputs_verify.py",
    "outputs/test_outputs_verify_run.py", "stages/test_stages_publish.py")}


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: without it installed, never called
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ModuleScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            return "export_runs" if module in EXPORT_RUNS_READERS else module

    return ModuleScheduling(config, log)


CONTAINER_TEST_FILE = "host/test_host_image.py"
collect_ignore = [] if CONTAINER_TESTS else [CONTAINER_TEST_FILE]


def pytest_report_header(config):
    if not CONTAINER_TESTS:
        return f"tests/{CONTAINER_TEST_FILE} not collected: set PIPELINE_CONTAINER_TESTS=1 (needs root to start dockerd)"
    return "container tests: on"


# ---- tiers: `make test-fast` runs what is not `slow` (≤ 90 s on 2 cores); `make test` runs everything ----
# A test is slow when it trains, makes the embedded models or builds images: it asks for one of these
# fixtures, or its module or function is marked `slow` itself.
SLOW_FIXTURES = {"embedded_checkpoints", "checkpoints", "tiny_root", "export_runs"}
# The tests of the modules that talk to torchtitan (its configs, model, loaders, trainer, names): what the
# simulated "main after #4328" tier (`make test-titan-sim`) runs of the fast tier, marked `titan`.
TITAN_TESTS = ("titan/", "models/", "checkpoint/test_checkpoint_arch_flops.py", "data/test_data_chat.py",
               "data/test_data_dataset.py", "training/test_training_memory.py",
               "training/test_training_titan_flags.py",
               "host/test_host_doctor_titan.py")


def pytest_collection_modifyitems(config, items):
    tests = Path(__file__).parent
    for item in items:
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if item.path.relative_to(tests).as_posix().startswith(TITAN_TESTS):
            item.add_marker(pytest.mark.titan)
    readers = {item.nodeid.split("::")[0] for item in items if "export_runs" in getattr(item, "fixturenames", ())}
    if readers - EXPORT_RUNS_READERS:
        raise pytest.UsageError(f"add {sorted(readers - EXPORT_RUNS_READERS)} to EXPORT_RUNS_READERS in tests/conftest.py "
                                "(the modules that share export_runs' worker)")
    # The container tests run last: .ci/run builds their image in the background meanwhile, and in
    # alphabetical order the suite reached them first and waited for it (119 s of a cold-engine run, 2026-12-02).
    items.sort(key=lambda item: item.path.as_posix().endswith(CONTAINER_TEST_FILE))
