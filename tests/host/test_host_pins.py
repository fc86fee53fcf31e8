"""pipeline/host/pins.py (`make pin`): the three values the trn2 run needs and no source here could give
(the fork's commit, the Hub revision, the base image's digest) are looked up once, written where each
belongs with every other byte kept, and a pinned value is never looked up again."""

from __future__ import annotations

import shutil
import tomllib

import pytest

from helpers import REPO
from pipeline.errors import PipelineError
from pipeline.host import pins
from pipeline.launch import image

FORK = "a" * 40
HUB = "b" * 40
DIGEST = "sha256:" + "c" * 64


@pytest.fixture
def tree(tmp_path):
    """The committed files, copied: requirements.lock, configs/models.toml, configs/base-image.toml."""
    files = {}
    for name in ("requirements.lock", "configs/models.toml", "configs/base-image.toml"):
        files[name] = tmp_path / name
        files[name].parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(REPO / name, files[name])
    return files


def _resolvers(asked: list):
    def branch(repository, branch):
        asked.append(("git", repository, branch))
        return FORK

    def hub(repo_id, revision):
        asked.append(("hub", repo_id, revision))
        return HUB

    def base(reference):
        asked.append(("base", reference))
        return DIGEST

    return pins.Resolvers(branch_commit=branch, hub_commit=hub, base_digest=base)


def _resolve(tree, asked, base_image=None):
    return pins.resolve(_resolvers(asked), base_image=base_image, lock=tree["requirements.lock"],
                        models=tree["configs/models.toml"], base_pin=tree["configs/base-image.toml"])


def test_the_committed_files_need_pinning_and_are_pinned_once(tree):
    """Today's files hold the placeholder, "main" and no digest: after `make pin` the lock passes the image
    build's check, PIPELINE_REQUIRE_PINNED accepts the revisions, and the default base is pinned by digest."""
    from pipeline.launch.image import check_lock

    with pytest.raises(PipelineError, match="COMMIT-UNKNOWN"):
        check_lock(tree["requirements.lock"])
    before = {name: path.read_text() for name, path in tree.items()}
    asked = []
    pinned = _resolve(tree, asked)
    models = [m for m, e in tomllib.loads(before["configs/models.toml"]).items() if isinstance(e, dict)]
    assert asked == [("git", "https://github.com/aws-neuron/torchtitan-neuron", "release-2.33"),
                     *[("hub", m, "main") for m in models],
                     ("base", tomllib.loads(before["configs/base-image.toml"])["reference"])]
    assert {p.value for p in pinned} == {FORK, HUB, DIGEST}
    lock = tree["requirements.lock"].read_text()
    assert f"torchtitan-neuron@{FORK}\n" in lock and "@COMMIT-UNKNOWN\n" not in lock
    assert lock.replace(FORK, "COMMIT-UNKNOWN") == before["requirements.lock"]  # the one pin changed
    check_lock(tree["requirements.lock"])  # the image build takes it now
    toml_models = tomllib.loads(tree["configs/models.toml"].read_text())
    assert all(toml_models[m]["revision"] == HUB for m in models)
    assert toml_models == {m: ({**e, "revision": HUB} if isinstance(e, dict) and "revision" in e else e)
                           for m, e in tomllib.loads(before["configs/models.toml"]).items()}
    assert tree["configs/models.toml"].read_text().count("\n") == before["configs/models.toml"].count("\n")  # comments kept
    base = image.pinned_base_image(tree["configs/base-image.toml"])
    assert base == f"{tomllib.loads(before['configs/base-image.toml'])['reference']}@{DIGEST}"
    # A second run looks nothing up and changes nothing.
    after = {name: path.read_text() for name, path in tree.items()}
    asked.clear()
    assert _resolve(tree, asked) == [] and asked == []
    assert {name: path.read_text() for name, path in tree.items()} == after


def test_a_given_base_image_is_the_one_recorded(tree):
    asked = []
    _resolve(tree, asked, base_image="123.dkr.ecr.us-east-1.amazonaws.com/neuron/pytorch-training:2.33")
    assert asked[-1] == ("base", "123.dkr.ecr.us-east-1.amazonaws.com/neuron/pytorch-training:2.33")
    assert image.pinned_base_image(tree["configs/base-image.toml"]) == \
        f"123.dkr.ecr.us-east-1.amazonaws.com/neuron/pytorch-training:2.33@{DIGEST}"
    asked.clear()
    assert _resolve(tree, asked, base_image="123.dkr.ecr.us-east-1.amazonaws.com/neuron/pytorch-training:2.33") == []
    assert asked == []  # the runner's BASE_IMAGE, once pinned, is not pulled again
    pinned_ref = "public.ecr.aws/x/y@" + "sha256:" + "d" * 64  # already pinned by digest: recorded as given
    _resolve(tree, asked, base_image=pinned_ref)
    assert asked == [] and image.pinned_base_image(tree["configs/base-image.toml"]) == pinned_ref


def test_a_failed_look_up_writes_nothing(tree):
    before = {name: path.read_text() for name, path in tree.items()}

    def offline(*_):
        raise PipelineError("the Hub did not resolve Qwen/Qwen3-0.6B@main (ConnectError).", "check the network.")

    resolvers = pins.Resolvers(branch_commit=lambda *_: FORK, hub_commit=offline, base_digest=lambda _: DIGEST)
    with pytest.raises(PipelineError, match="did not resolve"):
        pins.resolve(resolvers, lock=tree["requirements.lock"], models=tree["configs/models.toml"],
                     base_pin=tree["configs/base-image.toml"])
    assert {name: path.read_text() for name, path in tree.items()} == before  # the fork's commit was not written either


def test_an_answer_that_is_not_a_commit_is_refused(tree):
    resolvers = pins.Resolvers(branch_commit=lambda *_: FORK, hub_commit=lambda *_: "main", base_digest=lambda _: DIGEST)
    with pytest.raises(PipelineError, match="not a commit"):
        pins.resolve(resolvers, lock=tree["requirements.lock"], models=tree["configs/models.toml"],
                     base_pin=tree["configs/base-image.toml"])


def test_git_ls_remote_of_a_real_repository(tmp_path):
    """The fork's look-up is git's own: a local repository with a release branch stands in for GitHub."""
    import subprocess

    repo = tmp_path / "torchtitan-neuron"
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True, text=True)  # noqa: E731
    repo.mkdir()
    run("init", "-q", "-b", "main")
    run("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty", "-m", "x")
    run("branch", "release-2.33")
    head = run("rev-parse", "HEAD").stdout.strip()
    assert pins.git_branch_commit(str(repo), "release-2.33") == head
    with pytest.raises(PipelineError, match="gave no commit"):
        pins.git_branch_commit(str(repo), "release-9.99")
