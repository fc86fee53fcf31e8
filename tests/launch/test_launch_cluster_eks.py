"""The rendered EKS manifests against the Kubernetes API schemas (PyPI kubernetes-validate, which ships
them; strict: an unknown field is an error): the training Job, its ConfigMap and Service, and the staging
Job; they pull the pushed image by digest, mount the shared volume, carry the Hugging Face settings (the
token from a Secret), and restart a failed trainer into a resume instead of failing the Job."""

from __future__ import annotations

import json

import pytest
import yaml

from helpers import run_pipeline

kubernetes_validate = pytest.importorskip(
    "kubernetes_validate", reason="kubernetes-validate is not installed: `make setup-test` installs it from "
    "requirements-test.lock")

PUSHED = "123456789012.dkr.ecr.us-west-2.amazonaws.com/qwen3@sha256:" + "c" * 64
KUBERNETES = "1.33.0"  # EKS's current standard-support line; the schema the test validates against
MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # dry-run resolvable from configs/hub_configs


@pytest.fixture
def manifests(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", "/checkpoints/.hf-home")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_TOKEN", "hf_do_not_write_me")
    out = tmp_path / "eks"
    run_pipeline("launch", "--scheduler", "eks", "--nodes", "4", "--model", MODEL, "--image", PUSHED,
                 "--pvc", "fsx-claim", "--namespace", "training", "--output", str(out), root=tmp_path / "ckpt")
    return out


def docs(path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_every_manifest_validates_against_the_kubernetes_schemas(manifests):
    rendered = docs(manifests / "job.yaml") + docs(manifests / "stage.yaml")
    assert sorted(d["kind"] for d in rendered) == ["ConfigMap", "Job", "Job", "Service"]
    for doc in rendered:
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)  # raises ValidationError naming the field
    # The schemas do catch a broken manifest (so the loop above proves something).
    broken = docs(manifests / "job.yaml")[-1]
    broken["spec"]["template"]["spec"]["restartPolicy"] = 7
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, KUBERNETES, strict=True)


def test_pods_pull_by_digest_mount_the_share_carry_hf_and_restart_into_a_resume(manifests):
    kinds = {d["kind"]: d for d in docs(manifests / "job.yaml")}
    (stage,) = docs(manifests / "stage.yaml")
    job = kinds["Job"]
    for each in (job, stage):
        pod = each["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        assert container["image"] == PUSHED and each["metadata"]["namespace"] == "training"
        (volume,) = [v for v in pod["volumes"] if v["name"] == "checkpoints"]
        assert volume["persistentVolumeClaim"]["claimName"] == "fsx-claim"
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in container["volumeMounts"]
        env = {e["name"]: e for e in container["env"]}
        assert env["HF_HOME"]["value"] == "/checkpoints/.hf-home" and env["HF_HUB_OFFLINE"]["value"] == "1"
        assert env["HF_TOKEN"] == {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
            "name": "hf-token", "key": "token", "optional": True}}}
        assert env["PIPELINE_CHECKPOINTS"]["value"] == "/checkpoints"
    assert "hf_do_not_write_me" not in (manifests / "job.yaml").read_text() + (manifests / "stage.yaml").read_text()
    # A failed trainer restarts in its pod (same DNS name for the rendezvous), several times per node.
    assert job["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] == 3 * 4
    # It resumes: the run dir on the shared volume (where checkpoints are) is what run.json names.
    spec = json.loads(kinds["ConfigMap"]["data"]["run.json"])
    assert spec["run_dir"].startswith("/checkpoints/") and spec["source_dir"].startswith("/checkpoints/")
    # The staging job writes the model and the data where the trainer reads them.
    command = stage["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert f"-m pipeline download --model {MODEL}" in command and f"-m pipeline data --model {MODEL}" in command


def test_pods_work_on_a_root_owned_volume(manifests, tmp_path):
    """A fresh FSx volume's top directory is root's: the pods run as the image's UID-1000 user, so an init
    step (as root) gives that directory to the user before the stage or the trainer writes into it; fsGroup
    too, for CSI drivers that apply it. Run here against a directory shaped like that volume."""
    (stage,) = docs(manifests / "stage.yaml")
    job = {d["kind"]: d for d in docs(manifests / "job.yaml")}["Job"]
    for each in (stage, job):
        pod = each["spec"]["template"]["spec"]
        assert pod["securityContext"] == {"fsGroup": 1000, "fsGroupChangePolicy": "OnRootMismatch"}
        (container,) = pod["containers"]
        assert {k: container["securityContext"][k] for k in ("runAsUser", "runAsGroup", "runAsNonRoot")} == \
            {"runAsUser": 1000, "runAsGroup": 1000, "runAsNonRoot": True}
        (init,) = pod["initContainers"]
        assert init["image"] == PUSHED and init["securityContext"]["runAsUser"] == 0
        assert {"name": "checkpoints", "mountPath": "/checkpoints"} in init["volumeMounts"]
    script = stage["spec"]["template"]["spec"]["initContainers"][0]["command"][-1]
    # The step's script, with the volume path, chown and stat of this test: it changes the owner only when
    # it differs, and only of the top directory.
    volume = tmp_path / "volume"
    (volume / "old-run").mkdir(parents=True)
    calls = tmp_path / "calls"
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for tool, body in (("chown", f'echo "chown $*" >> {calls}'), ("stat", 'echo "${OWNER}"')):
        (fake_bin / tool).write_text(f"#!/bin/sh\n{body}\n")
        (fake_bin / tool).chmod(0o755)
    import subprocess

    env = {"PATH": f"{fake_bin}:/usr/bin:/bin"}
    local = script.replace("d=/checkpoints", f"d={volume}")
    out = subprocess.run(["sh", "-c", local], env={**env, "OWNER": "0:0"}, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert calls.read_text().split("\n")[0] == f"chown 1000:1000 {volume}" and "gave" in out.stdout
    calls.unlink()
    out = subprocess.run(["sh", "-c", local], env={**env, "OWNER": "1000:1000"}, capture_output=True, text=True)
    assert out.returncode == 0 and not calls.exists()  # already the user's: nothing changed


@pytest.mark.parametrize("efa", ["8", "0"])
def test_the_efa_count_is_a_variable_and_still_validates(tmp_path, efa):
    out = tmp_path / "eks"
    nodes = "2" if efa != "0" else "1"
    run_pipeline("launch", "--scheduler", "eks", "--nodes", nodes, "--model", MODEL, "--image", PUSHED,
                 "--efa-devices", efa, "--output", str(out), root=tmp_path / "ckpt")
    job = {d["kind"]: d for d in docs(out / "job.yaml")}["Job"]
    (container,) = job["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    for kind in ("requests", "limits"):
        assert container["resources"][kind].get("vpc.amazonaws.com/efa") == (int(efa) or None)
        assert container["resources"][kind]["aws.amazon.com/neuron"] == 16
    assert ("FI_PROVIDER" in env) == (efa != "0")  # no EFA devices: libfabric is not told to use EFA
    for doc in docs(out / "job.yaml") + docs(out / "stage.yaml"):
        kubernetes_validate.validate(doc, KUBERNETES, strict=True)


def test_no_efa_on_more_than_one_node_is_refused(tmp_path):
    result = run_pipeline("launch", "--scheduler", "eks", "--nodes", "2", "--model", MODEL, "--image", PUSHED,
                          "--efa-devices", "0", "--output", str(tmp_path / "o"), root=tmp_path, check=False)
    assert result.returncode == 2 and "EFA_DEVICES=0 with NODES=2" in result.stderr
    assert not (tmp_path / "o").exists()
