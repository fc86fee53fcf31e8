"""run/targets.py, stages/launch.py, stages/image.py, Dockerfile: TorchNeuron's compile cache is
TORCH_NEURONX_NEFF_CACHE_DIR, one persistent directory, so a second run with the same shapes reuses
the compiled graphs (issue 12, finding 12; torch/reference/env-vars in shared/notes/neuron.md)."""

from __future__ import annotations

import argparse
import re
import subprocess

from conftest import REPO
from pipeline.run import targets
from pipeline.stages import image, launch

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
    assert targets.TARGETS["cpu"].launch_env({"A": "1"}) == {"A": "1", **targets.TARGETS["cpu"].env}


def test_no_module_sets_the_torch_xla_variable():
    tracked = subprocess.run(["git", "ls-files", "pipeline", "Dockerfile", "Makefile", ".github", "docker"], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.split()
    users = [f for f in tracked if re.search(rf"{OLD}(\"|=)", (REPO / f).read_text())]
    assert users == []


def test_image_mounts_the_host_cache_where_the_image_points_torchneuron():
    dockerfile = (REPO / "Dockerfile").read_text()
    (path,) = re.findall(rf"{NEW}=(\S+)", dockerfile)
    assert path == image.IMAGE_COMPILE_CACHE == targets.DEFAULT_NEFF_CACHE


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
    assert seen["environment"][NEW] == image.IMAGE_COMPILE_CACHE
    assert seen["volumes"][str(tmp_path / "neff")]["bind"] == image.IMAGE_COMPILE_CACHE


def test_slurm_nodes_share_one_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("PIPELINE_CHECKPOINTS", str(tmp_path))
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)  # every flag at its default, as a user's command line would give them
    args = parser.parse_args(["--scheduler", "slurm", "--nodes", "2", "--model", "Qwen/Qwen3-0.6B",
                              "--cluster-checkpoints", "/fsx/checkpoints", "--output", str(tmp_path / "out")])
    script = launch.render_slurm(launch.plan(args))["train.sbatch"]
    assert f"export {NEW}=/fsx/checkpoints/.neuron-compile-cache" in script
    assert f'mkdir -p "${NEW}"' in script and OLD not in script
