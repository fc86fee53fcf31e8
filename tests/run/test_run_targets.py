"""run/targets.py, stages/launch.py, stages/image.py, Dockerfile: TorchNeuron's compile cache is
TORCH_NEURONX_NEFF_CACHE_DIR, one persistent directory, so a second run with the same shapes reuses
the compiled graphs (issue 12, finding 12; neuron:torch/reference/env-vars.html, docs/sources.md).
On CPU, glibc keeps freed memory (large mmap/trim thresholds: a step over the vocabulary no longer
re-faults its logits) only for runs needing at most a quarter of the machine (issue 14)."""

from __future__ import annotations

import argparse
import json
import re
import subprocess

from helpers import REPO
from pipeline.checkpoint.arch import arch_from_config
from pipeline.run import targets
from pipeline.launch.image import IMAGE
from pipeline.run.settings import CONFIG_DIR, TrainSettings
from pipeline.training import memory
from pipeline.host import image
from pipeline.stages import launch as launch_stage
from pipeline.launch import cluster

OLD = "NEURON_COMPILE_CACHE_URL"
NEW = "TORCH_NEURONX_NEFF_CACHE_DIR"


def test_trn2_launch_sets_the_variable_torchneuron_reads():
    trn2 = targets.TARGETS["trn2"]
    env = trn2.launch_env({"PATH": "/usr/bin"})
    assert env[NEW] == targets.DEFAULT_NEFF_CACHE and OLD not in env
    # The same persistent directory for every launch: outside the run dir (FRESH=1 wipes that).
    assert trn2.launch_env({})[NEW] == env[NEW] and not env[NEW].startswith("/tmp")
    # A cache the user chose wins over the default.
    assert trn2.launch_env({NEW: "/fsx/neff"})[NEW] == "/fsx/neff"
    # CPU: glibc keeps freed memory unless the run is known to need much of the machine (below).
    assert targets.TARGETS["cpu"].launch_env({"A": "1"}) == {"A": "1", **targets.RETAIN_FREED_MEMORY}


def test_no_module_sets_the_torch_xla_variable():
    tracked = subprocess.run(["git", "ls-files", "pipeline", "Dockerfile", "Makefile", ".github", "docker"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    users = [f for f in tracked if re.search(rf"{OLD}(\"|=)", (REPO / f).read_text())]
    assert users == []


def test_image_mounts_the_host_cache_where_the_image_points_torchneuron():
    dockerfile = (REPO / "Dockerfile").read_text()
    (path,) = re.findall(rf"{NEW}=(\S+)", dockerfile)
    assert path == IMAGE.compile_cache == targets.DEFAULT_NEFF_CACHE


def test_container_run_passes_the_image_cache_path(monkeypatch, tmp_path):
    """The container gets the mount path, never a host path it cannot see."""
    seen = {}

    def fake_stream(engine, image_name, command, **kwargs):
        seen.update(kwargs)
        return 0

    monkeypatch.setattr(image, "stream_container", fake_stream)
    monkeypatch.setenv(NEW, "/host/only/path")
    request = image.ContainerRun(image="x", argv=["doctor"], checkpoints=tmp_path / "c", hf_cache=tmp_path / "h",
                                 compile_cache=tmp_path / "neff")
    assert image.run_in_image(request, engine=object()) == 0
    assert seen["environment"][NEW] == IMAGE.compile_cache
    assert seen["volumes"][str(tmp_path / "neff")]["bind"] == IMAGE.compile_cache


def test_container_run_carries_the_users_hugging_face_settings(monkeypatch, tmp_path):
    """HF_HUB_OFFLINE / HF_ENDPOINT reach the container as set; HF_HOME and HF_HUB_CACHE as mounts at the
    image's paths (a host path means nothing inside)."""
    seen = {}
    monkeypatch.setattr(image, "stream_container", lambda engine, name, command, **kwargs: seen.update(kwargs) or 0)
    for name, value in (("HF_HUB_OFFLINE", "1"), ("HF_ENDPOINT", "https://hf-mirror.example"),
                        ("HF_HOME", str(tmp_path / "hf")), ("HF_HUB_CACHE", str(tmp_path / "hub")),
                        ("PIPELINE_CHECKPOINTS", str(tmp_path / "c")), ("PIPELINE_COMPILE_CACHE", str(tmp_path / "n"))):
        monkeypatch.setenv(name, value)
    assert image.run_in_image(image.container_run("x", ["doctor"]), engine=object()) == 0
    env, volumes = seen["environment"], seen["volumes"]
    assert env["HF_HUB_OFFLINE"] == "1" and env["HF_ENDPOINT"] == "https://hf-mirror.example"
    assert env["HF_HUB_CACHE"] == "/hf-cache/hub" and "HF_HOME" not in env  # the image's HF_HOME=/hf-cache
    assert volumes[str(tmp_path / "hf")]["bind"] == "/hf-cache" and volumes[str(tmp_path / "hub")]["bind"] == "/hf-cache/hub"


def test_slurm_nodes_share_one_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path))
    parser = argparse.ArgumentParser(allow_abbrev=False)
    launch_stage.add_arguments(parser)  # every flag at its default, as a user's command line would give them
    args = parser.parse_args(["--scheduler", "slurm", "--nodes", "2", "--model", "Qwen/Qwen3-0.6B",
                              "--cluster-checkpoints", "/fsx/checkpoints", "--output", str(tmp_path / "out"),
                              "--image", "r.example/q@sha256:" + "0" * 64])
    script = cluster.render_slurm(cluster.plan(launch_stage.request(args)))["train.sbatch"]
    assert f"export {NEW}=/fsx/checkpoints/.neuron-compile-cache" in script
    assert f'mkdir -p "${NEW}"' in script and OLD not in script


CPU = targets.TARGETS["cpu"]


def arch(name: str):
    return arch_from_config(json.loads((CONFIG_DIR / "hub_configs" / f"{name}.json").read_text()))


def need(model, ranks: int = 2) -> int:
    per_rank = memory.estimate(model, TrainSettings(nproc_per_node=ranks), "native", "cpu").total
    return int((per_rank + memory.CPU_PROCESS_GIB * memory.GIB) * ranks)


def test_tiny_runs_keep_freed_memory(monkeypatch):
    monkeypatch.setattr(targets, "physical_memory_bytes", lambda: 24 * 2**30)
    from pipeline.checkpoint.embedded import EMBEDDED

    tiny = arch_from_config(EMBEDDED["tiny"].config)
    assert CPU.launch_vars({}, need(tiny)) == targets.RETAIN_FREED_MEMORY


def test_a_real_model_gets_glibc_defaults(monkeypatch):
    monkeypatch.setattr(targets, "physical_memory_bytes", lambda: 24 * 2**30)
    assert CPU.launch_vars({}, need(arch("Qwen3-0.6B"))) == {}
    monkeypatch.setattr(targets, "physical_memory_bytes", lambda: 2048 * 2**30)
    assert CPU.launch_vars({}, need(arch("Qwen3-0.6B"))) == targets.RETAIN_FREED_MEMORY


def test_other_targets_keep_their_own_environment():
    assert "MALLOC_MMAP_THRESHOLD_" not in targets.TARGETS["trn2"].launch_vars({}, 1)
    assert targets.TARGETS["cuda"].launch_vars({}, 1) == {}
