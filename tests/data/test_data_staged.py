"""pipeline/data/staged.py: DATASET=c4 staged once into the checkpoints root, read by the ranks from there,
staged by the launch files before any rank starts.

The Hub is unreachable here: the source is a local stand-in laid out like allenai/c4
(en/c4-train.0000X-of-01024.json.gz, gzipped JSON lines of text/timestamp/url), given as DATASET_MIRROR."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.data import dataset, staged
from helpers import C4_MARKER, c4_stand_in, run_pipeline

COMMIT = "1588ec454efa1a09f29cd18ddd04fe05fc8653a2"  # what the stand-in is said to mirror
MODEL = "Qwen/Qwen3-4B-Instruct-2507"  # dry-run resolvable from configs/hub_configs (trn2's default: c4)


def stage(root: Path, mirror: Path, *extra: str, check: bool = True):
    return run_pipeline("data", "--model", "tiny", "--dataset", "c4", "--mirror", str(mirror), *extra,
                        root=root, check=check)


def test_c4_is_staged_once_with_its_record(tmp_path):
    mirror, root = c4_stand_in(tmp_path / "c4"), tmp_path / "ckpt"
    done = stage(root, mirror, "--shards", "2", "--dataset-revision", COMMIT)
    where = root / "data" / "sets" / "c4"
    assert "DATASET=c4 staged: 2 shard(s) of allenai/c4 at " + COMMIT in done.stdout
    assert sorted(p.name for p in (where / "en").iterdir()) == [f"c4-train.{i:05d}-of-01024.json.gz" for i in range(2)]
    record = json.loads((where / staged.RECORD).read_text())
    assert (record["repo_id"], record["commit"], record["source"]) == ("allenai/c4", COMMIT, str(mirror.resolve()))
    from pipeline.checkpoint import manifest

    assert [s["sha256"] for s in record["shards"]] == [manifest.sha256(where / s["path"]) for s in record["shards"]]
    first = (where / "en" / "c4-train.00000-of-01024.json.gz").stat()
    # again, nothing asked that differs (and no shard count): checked, not copied
    again = stage(root, mirror)
    assert "DATASET=c4 up to date: 2 shard(s)" in again.stdout
    assert (where / "en" / "c4-train.00000-of-01024.json.gz").stat().st_ino == first.st_ino
    # a staged file changed: copied again
    (where / "en" / "c4-train.00001-of-01024.json.gz").write_bytes(b"torn")
    assert "DATASET=c4 staged: 2 shard(s)" in stage(root, mirror).stdout
    # more shards asked: copied again, the record says so
    stage(root, mirror, "--shards", "3", "--dataset-revision", COMMIT)
    assert len(json.loads((where / staged.RECORD).read_text())["shards"]) == 3


def test_staging_refusals_are_one_line_and_leave_nothing(tmp_path):
    mirror, root = c4_stand_in(tmp_path / "c4", shards=1), tmp_path / "ckpt"
    refused = stage(root, mirror, "--shards", "2", check=False)  # the mirror has one shard
    assert refused.returncode == 2 and "has no en/c4-train.00001-of-01024.json.gz" in refused.stderr
    assert not (root / "data" / "sets" / "c4").exists()
    assert not [p for p in (root / "data" / "sets").iterdir()]  # no half-staged temporary left
    unpinned = run_pipeline("data", "--model", "tiny", "--dataset", "c4", "--mirror", str(mirror), "--shards", "1",
                            root=root, check=False, env={"PIPELINE_REQUIRE_PINNED": "1"})
    assert unpinned.returncode == 2 and "revision 'main', not a commit" in unpinned.stderr
    wrong = run_pipeline("data", "--model", "tiny", "--shards", "2", root=root, check=False)
    assert wrong.returncode == 2 and "DATASET=(unset) is not one" in wrong.stderr


def test_a_run_on_c4_reads_the_staged_files_or_is_refused(tmp_path):
    root = tmp_path / "ckpt"
    local = root / "tiny" / "data" / "train.jsonl"
    with pytest.raises(PipelineError) as err:
        dataset.resolve("c4", local)
    assert "it is not staged" in err.value.problem and "make data DATASET=c4" in err.value.fix
    assert dataset.resolve("c4", local, check_local=False).kind == "staged"  # a dry run before staging
    stage(root, c4_stand_in(tmp_path / "c4"), "--shards", "2")
    source = dataset.resolve("c4", local)
    assert source == dataset.DataSource("staged", "c4", str(root / "data" / "sets" / "c4"))
    dataset.check_readable(source)  # FRESH=1's read: every staged byte against its sha256
    (root / "data" / "sets" / "c4" / "en" / "c4-train.00001-of-01024.json.gz").write_bytes(b"\x1f\x8b torn")
    with pytest.raises(PipelineError) as err:
        dataset.check_readable(source)
    assert "is not the one staged (sha256 differs" in err.value.problem


def test_torchtitan_reads_the_staged_shards(tmp_path):
    """In a rank: the registered loader is torchtitan's own, over the staged .json.gz files (no Hub)."""
    from torchtitan.components.tokenizer import HuggingFaceTokenizer

    from pipeline.checkpoint.embedded import tokenizer_dir
    from pipeline.titan import api

    root = tmp_path / "ckpt"
    stage(root, c4_stand_in(tmp_path / "c4"), "--shards", "2")
    source = dataset.resolve("c4", root / "tiny" / "data" / "train.jsonl")
    name = dataset.register(source)
    assert name == dataset.REGISTERED_NAME["staged"]
    tokenizer = HuggingFaceTokenizer(tokenizer_path=str(tokenizer_dir()))
    loader = api.build_text_loader(api.text_dataloader(source, name), tokenizer=tokenizer, seq_len=256,
                                   local_batch_size=1)
    first, _labels = next(iter(loader))
    text = tokenizer.decode(first["input"].flatten().tolist())
    assert "shard 0 document 0" in text and "shard 0 document 1" in text, text


def test_launch_files_stage_c4_once_before_the_ranks(tmp_path):
    out = tmp_path / "slurm"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--runtime", "venv",
                 "--output", str(out), root=tmp_path / "ckpt")
    spec = json.loads((out / "run.json").read_text())
    assert (spec["data_kind"], spec["data_file"]) == ("staged", "/fsx/checkpoints/data/sets/c4")
    text = (out / "train.sbatch").read_text()
    step = text.index("srun --nodes=1 --ntasks=1 bash -c \"$STAGE_CMD\"")
    assert step < text.index('srun --kill-on-bad-exit=1')  # before the ranks' srun
    assert "-m pipeline data --model Qwen/Qwen3-4B-Instruct-2507 --dataset c4" in text[text.index("STAGE_CMD="):step]
    eks = tmp_path / "eks"
    run_pipeline("launch", "--scheduler", "eks", "--nodes", "2", "--model", MODEL, "--image",
                 "registry.example/q@sha256:" + "a" * 64, "--output", str(eks), root=tmp_path / "ckpt")
    import yaml

    stage_job = yaml.safe_load((eks / "stage.yaml").read_text())
    command = stage_job["spec"]["template"]["spec"]["containers"][0]["command"][-1]
    assert "-m pipeline data --model Qwen/Qwen3-4B-Instruct-2507 --dataset c4" in command


@pytest.mark.slow
def test_the_ranks_train_on_the_staged_shards(checkpoints, tmp_path):
    """Two ranks, one step of tiny on DATASET=c4: the recorded first batch is the staged stand-in's text."""
    from safetensors.torch import load_file
    from tokenizers import Tokenizer

    from helpers import cli, copy_model
    from tiny_checkpoint import ok

    root = copy_model(checkpoints, tmp_path / "root", link=True)
    stage(root, c4_stand_in(tmp_path / "c4", shards=2, docs=8), "--shards", "2")
    ok(cli("train", "--model", "tiny", "--path", "native", "--steps", "1", "--nproc-per-node", "2",
           "--dataset", "c4", "--name", "c4", root=root, env={"HF_HUB_OFFLINE": "1"}))
    run = root / "tiny" / "runs" / "c4"
    spec = json.loads((run / "run.json").read_text())
    assert (spec["data_kind"], spec["data_file"]) == ("staged", str(root / "data" / "sets" / "c4"))
    tokenizer = Tokenizer.from_file(str(root / "tiny" / "source" / "tokenizer.json"))
    texts = [tokenizer.decode(load_file(str(run / "first_batch" / f"rank{r}.safetensors"))["input"].flatten().tolist())
             for r in (0, 1)]
    assert all(C4_MARKER in text for text in texts), texts


def test_a_local_dataset_is_carried_and_staged_never_a_host_path(tmp_path):
    """DATASET=<a file on this host>: run.json names its copy under the shared root, the sbatch's staging step
    copies it there from the launch folder (sha256 checked); EKS, whose pods mount only the volume, refuses."""
    import subprocess

    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"text": f"my document {i} " * 5}) + "\n" for i in range(64)))  # ≥ 32 DP ranks
    out, shared = tmp_path / "slurm", tmp_path / "fsx"
    run_pipeline("launch", "--scheduler", "slurm", "--nodes", "2", "--model", MODEL, "--runtime", "venv",
                 "--dataset", str(mine), "--cluster-checkpoints", str(shared), "--output", str(out), root=tmp_path / "ckpt")
    spec = json.loads((out / "run.json").read_text())
    assert str(tmp_path / "mine.jsonl") not in (out / "run.json").read_text()
    assert spec["data_file"].startswith(f"{shared}/data/carried/mine-") and spec["data_file"].endswith("/mine.jsonl")
    text = (out / "train.sbatch").read_text()
    stage_cmd = text[text.index("STAGE_CMD="):text.index("srun --nodes=1")]
    # run the staging step's copy as a node would: the file lands where run.json says, checked
    copy = stage_cmd.split("&& ", 1)[1].rsplit("\nSTAGE", 1)[0]
    done = subprocess.run(["bash", "-c", copy], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert Path(spec["data_file"]).read_bytes() == mine.read_bytes()
    refused = run_pipeline("launch", "--scheduler", "eks", "--nodes", "2", "--model", MODEL, "--image",
                           "registry.example/q@sha256:" + "a" * 64, "--dataset", str(mine), "--output",
                           str(tmp_path / "eks"), root=tmp_path / "ckpt", check=False)
    assert refused.returncode == 2 and "a file on this host; the EKS pods mount only the checkpoints volume" in refused.stderr
    assert not (tmp_path / "eks").exists()
