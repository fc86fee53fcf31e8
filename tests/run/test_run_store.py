"""The model store: checkpoints/<key>/ keyed by the full source, Hub weights in the Hugging Face
cache (recorded by commit in source.json, resolved offline), REVISION checked against the download.

The Hub is unreachable here, so a Hugging Face cache is built by hand in a temporary HF_HOME, in
the layout huggingface_hub writes (hub/models--org--name/{refs/main, snapshots/<commit>/}), holding
the embedded tiny's files, and every command runs with HF_HUB_OFFLINE=1."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pipeline.errors import PipelineError
from pipeline.run import store
from helpers import cli, dry_run_spec
from tiny_checkpoint import ok, one_error_line


REPO_ID = "someorg/tiny"
COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER_COMMIT = "fedcba9876543210fedcba9876543210fedcba98"


# ---- keys --------------------------------------------------------------------------------------

def test_keys_name_the_full_source(tmp_path):
    assert store.parse_model("tiny").key == "tiny" and store.parse_model("tiny").kind == "embedded"
    assert store.parse_model("tiny-moe").key == "tiny-moe"
    hub = store.parse_model("Qwen/Qwen3-0.6B")
    assert (hub.kind, hub.key, hub.repo_id, hub.name) == ("hub", "Qwen--Qwen3-0.6B", "Qwen/Qwen3-0.6B", "Qwen3-0.6B")
    assert store.parse_model(REPO_ID).key == "someorg--tiny"  # never the embedded tiny's folder
    one, two = tmp_path / "a" / "ckpt", tmp_path / "b" / "ckpt"
    one.mkdir(parents=True)
    two.mkdir(parents=True)
    key_one, key_two = store.parse_model(str(one)).key, store.parse_model(str(two)).key
    assert key_one.startswith("local--ckpt-") and len(key_one) == len("local--ckpt-") + 8
    assert key_one != key_two  # same folder name, different directories: different keys
    assert store.parse_model(str(one) + "/").key == key_one  # the same directory spelled another way


@pytest.mark.parametrize("model", ["org/name/extra", "/no/such/dir", "./missing", "org/", "/org", "a b/c"])
def test_malformed_models_are_refused(model):
    with pytest.raises(PipelineError):
        store.parse_model(model)


def test_revision_only_applies_to_hub_models():
    with pytest.raises(PipelineError, match="applies to Hub models"):
        store.check_revision_applies(store.parse_model("tiny"), "abc")
    store.check_revision_applies(store.parse_model(REPO_ID), "abc")


# ---- the Hugging Face cache --------------------------------------------------------------------

def build_hf_cache(hf_home: Path, files: Path) -> Path:
    repo = hf_home / "hub" / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / COMMIT
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snapshot


@pytest.fixture(scope="module")
def hub(tiny_root, tmp_path_factory):
    """(checkpoints root, env, snapshot dir): someorg/tiny in a fake HF cache, downloaded."""
    base = tmp_path_factory.mktemp("hub")
    snapshot = build_hf_cache(base / "hf_home", tiny_root / "tiny" / "source")
    env = {"HF_HOME": str(base / "hf_home"), "HF_HUB_OFFLINE": "1"}
    root = base / "checkpoints"
    first = ok(cli("download", "--model", REPO_ID, root=root, env=env))
    return root, env, snapshot, first


def test_download_records_the_commit_and_leaves_weights_in_the_cache(hub):
    root, _env, snapshot, first = hub
    record = json.loads((root / "someorg--tiny" / "source.json").read_text())
    assert record == {"kind": "hub", "model": REPO_ID, "repo_id": REPO_ID, "revision": "main", "commit": COMMIT}
    assert str(snapshot) in first.stdout
    source = root / "someorg--tiny" / "source"  # no copy: a link into the cache (which other HF tools share)
    assert source.is_symlink() and source.resolve() == snapshot.resolve()


def test_download_again_at_the_recorded_commit_is_a_no_op(hub):
    root, env, _snapshot, _ = hub
    again = ok(cli("download", "--model", REPO_ID, "--revision", COMMIT, root=root, env=env))
    assert "already downloaded" in again.stdout


def test_a_revision_not_in_the_cache_is_one_line_and_keeps_the_download(hub):
    root, env, _snapshot, _ = hub
    result = cli("download", "--model", REPO_ID, "--revision", OTHER_COMMIT, root=root, env=env)
    line = one_error_line(result)
    assert f"{REPO_ID}@{OTHER_COMMIT} is not in the Hugging Face cache" in line and "HF_HUB_OFFLINE" in line
    assert json.loads((root / "someorg--tiny" / "source.json").read_text())["commit"] == COMMIT


def test_dry_run_resolves_the_source_from_the_cache(hub):
    root, env, snapshot, _ = hub
    result = ok(cli("train", "--model", REPO_ID, "--path", "native", "--dry-run", root=root, env=env))
    spec = dry_run_spec(result.stdout)
    assert spec["source_dir"] == str(snapshot) and spec["model_key"] == "someorg--tiny"
    pinned = ok(cli("train", "--model", REPO_ID, "--path", "native", "--dry-run", "--revision", COMMIT,
                             root=root, env=env))
    assert dry_run_spec(pinned.stdout)["source_dir"] == str(snapshot)


def test_revision_mismatch_is_one_line(hub):
    root, env, _snapshot, _ = hub
    result = cli("train", "--model", REPO_ID, "--path", "native", "--dry-run", "--revision", OTHER_COMMIT,
                          root=root, env=env)
    line = one_error_line(result)
    assert "downloaded at revision 'main'" in line and OTHER_COMMIT in line


def test_revision_on_an_embedded_model_is_refused(tiny_root):
    result = cli("train", "--model", "tiny", "--path", "native", "--dry-run", "--revision", COMMIT,
                          root=tiny_root)
    assert "applies to Hub models" in one_error_line(result)


def test_a_cache_that_lost_the_snapshot_is_one_line(hub, tmp_path):
    root, _env, _snapshot, _ = hub
    env = {"HF_HOME": str(tmp_path / "empty_hf_home"), "HF_HUB_OFFLINE": "1"}
    result = cli("train", "--model", REPO_ID, "--path", "native", "--dry-run", root=root, env=env)
    assert "is no longer in the Hugging Face cache" in one_error_line(result)


def test_one_real_step_from_the_cache(hub):
    root, env, snapshot, _ = hub
    ok(cli("data", "--model", REPO_ID, root=root, env=env))
    ok(cli("train", "--model", REPO_ID, "--path", "native", "--steps", "1", "--nproc-per-node", "1",
                    "--revision", COMMIT, root=root, env=env))
    run_dir = root / "someorg--tiny" / "runs" / "native"
    assert json.loads((run_dir / "run.json").read_text())["source_dir"] == str(snapshot)
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1]
    assert metrics[0]["loss"] < 9.0  # the cached weights loaded (ln 151936 = 11.93 if they had not)


# ---- someorg/tiny is not the embedded tiny -----------------------------------------------------

def test_hub_model_named_like_an_embedded_one_never_reuses_it(tiny_root, tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf_home"), "HF_HUB_OFFLINE": "1"}
    embedded_record = (tiny_root / "tiny" / "source.json").read_text()
    train = cli("train", "--model", REPO_ID, "--path", "native", "--steps", "1", root=tiny_root, env=env)
    assert f"{REPO_ID!r} has not been downloaded" in one_error_line(train)
    download = cli("download", "--model", REPO_ID, root=tiny_root, env=env)
    assert "is not in the Hugging Face cache" in one_error_line(download)
    assert not (tiny_root / "someorg--tiny" / "source.json").exists()
    assert (tiny_root / "tiny" / "source.json").read_text() == embedded_record


def test_the_embedded_record_names_the_pinned_corpus(tiny_root):
    from pipeline.checkpoint import corpus

    record = json.loads((tiny_root / "tiny" / "source.json").read_text())
    assert record == {"kind": "embedded", "model": "tiny", "corpus_sha256": corpus.SHA256}


def test_a_record_of_another_source_is_refused(tmp_path):
    home = store.home(REPO_ID, tmp_path)
    home.dir.mkdir(parents=True)
    home.source_record.write_text(json.dumps({"kind": "embedded", "model": "tiny"}))
    with pytest.raises(PipelineError, match="records embedded 'tiny', not hub 'someorg/tiny'"):
        home.source_dir()
