"""titan/internals.py: every private torchtitan name listed once, reached only through titan/accessors.py,
and checked before any rank starts (issue 12, finding 9: the image runs torchtitan-neuron
"0.2.2+neuron.1", not 0.3.0)."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

from helpers import REPO
from pipeline.errors import PipelineError
from pipeline.titan import internals

# The only modules that name private torchtitan names: the list of them and the accessors.
PRIVATE_ACCESS = {REPO / "pipeline" / "titan" / "internals.py", REPO / "pipeline" / "titan" / "accessors.py"}


def _torchtitan_private_uses(path: Path) -> list[str]:
    """`x._name` attribute reads and `_name=` keywords on torchtitan objects, approximated: any
    underscore attribute/keyword in a module that imports torchtitan, minus self/cls/super/torch-only ones."""
    text = path.read_text()
    if "torchtitan" not in text:
        return []
    tree = ast.parse(text)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__"):
            base = node.value
            if isinstance(base, ast.Name) and base.id in ("self", "cls", "ctx", "sys", "os", "torch"):
                continue
            if isinstance(base, ast.Call) and isinstance(base.func, ast.Name) and base.func.id == "super":
                continue
            found.append(f"{path.relative_to(REPO)}:{node.lineno} .{node.attr}")
        elif isinstance(node, ast.keyword) and node.arg and node.arg.startswith("_"):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} {node.arg}=")
        elif isinstance(node, ast.FunctionDef) and node.name in ("_save", "_load", "_find_load_step",
                                                                 "_create_checkpoint_id"):
            found.append(f"{path.relative_to(REPO)}:{node.lineno} def {node.name}")
    return found


def test_private_torchtitan_uses_live_only_in_internals_and_accessors():
    uses = [u for f in sorted((REPO / "pipeline").rglob("*.py")) if f not in PRIVATE_ACCESS
            for u in _torchtitan_private_uses(f)]
    # Private names of other libraries that the heuristic cannot tell from torchtitan's, each named with its owner.
    not_torchtitan = {"._attn_implementation": "transformers config", "._name_or_path": "transformers config (export's PEFT model)", "._experts_implementation": "transformers config",
                      "._init_weights": "transformers PreTrainedModel", "._get_fsdp_state": "torch FSDP2 module",
                      "._mp_policy": "torch FSDP2 state", "._schema": "torch OpOverload", "._type": "torch DTensor op",
                      "._run_exitfuncs": "CPython atexit (a finished rank's exit, training/entry.py)",
                      "._get_available_device_type": "torch._utils (the CPU device patch, titan/patches.py)",
                      "._get_gradient_divide_factors": "torch FSDP2 collectives (the gloo patch, titan/patches.py)"}
    assert [u for u in uses if u.rsplit(" ", 1)[1] not in not_torchtitan] == []


def test_every_listed_internal_exists_on_the_installed_torchtitan():
    """On both APIs the pipeline runs on (the main tier runs this file on upstream main)."""
    from pipeline.titan import api

    assert api.variant() == api.variant_of_imported() in (api.V030, api.MAIN)
    assert (internals.torchtitan_version(), api.variant()) in internals.VERIFIED  # what the launcher trusts unchecked
    for target in ("cpu", "trn2", "cuda"):
        assert internals.missing_internals(internals.internals_for(target)) == []


def test_a_missing_internal_is_named_with_the_expected_version():
    gone = internals.TitanName("torchtitan.models.qwen3", "_build_qwen3_layers_renamed", "test")
    gone_param = internals.TitanName("torchtitan.config.configurable", "Configurable.Config.traverse", "test",
                                 parameter="_root")
    with pytest.raises(PipelineError) as err:
        internals.check_torchtitan("trn2", internals=internals.TORCHTITAN_INTERNALS + (gone, gone_param))
    text = str(err.value)
    assert "torchtitan.models.qwen3._build_qwen3_layers_renamed" in text
    assert "torchtitan.config.configurable.Configurable.Config.traverse(_root=)" in text
    assert f"written against torchtitan {internals.WRITTEN_AGAINST}" in text and "\n" not in text


def test_train_refuses_another_torchtitan_before_anything_starts(tmp_path):
    """A stand-in torchtitan-neuron (metadata 0.2.2+neuron.1, none of 0.3.0's internals) first on the
    path: `train` stops with one line naming what is missing, before resolving or launching."""
    fake = tmp_path / "site"
    (fake / "torchtitan").mkdir(parents=True)
    (fake / "torchtitan" / "__init__.py").write_text("")
    info = fake / "torchtitan-0.2.2+neuron.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchtitan\nVersion: 0.2.2+neuron.1\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{REPO}", "PIPELINE_CHECKPOINTS": str(tmp_path / "ck")}
    for extra in ([], ["--dry-run"]):
        result = subprocess.run([sys.executable, "-m", "pipeline", "train", "--model", "tiny", "--path", "native",
                                 "--target", "cpu", *extra], cwd=REPO, env=env, capture_output=True, text=True,
                                timeout=300)
        assert result.returncode == 2, result.stderr
        (line,) = result.stderr.strip().splitlines()
        assert line.startswith("error: torchtitan 0.2.2+neuron.1 lacks ")
        assert "torchtitan.models.qwen3._build_qwen3_layers" in line and "torchtitan 0.3.0" in line
        assert not (tmp_path / "ck").exists()  # nothing resolved, downloaded or launched
