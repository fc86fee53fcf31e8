"""Every fact has one home: the spellings that used to be repeated across modules now appear only in
the module that owns them (issue 18). A new copy fails here, naming the file and the owner to use."""

from __future__ import annotations

import re

import pytest

from helpers import REPO

# (what, a pattern matching a spelling of the fact in code, the one file allowed to spell it)
HOMES = [
    ("run.json's file name", r'"run\.json"', "pipeline/run/rundir.py"),
    ("the run spec's JSON form", r"json\.dumps\(\s*(self|spec)\.to_dict\(\)", "pipeline/run/spec.py"),
    ("paths inside the image", r"/opt/pipeline|\"/checkpoints\"|\"/hf-cache", "pipeline/launch/image.py"),
    ("the Neuron device glob", r"neuron\[0-9\]", "pipeline/run/targets.py"),
    ("the LNC variable", r'"NEURON_LOGICAL_NC_CONFIG"', "pipeline/run/targets.py"),
    ("trn2 per-node counts", r"(DEVICES|_NODE)\w* = 16\b", "pipeline/run/targets.py"),
    ("safetensors dtype codes", r'"BF16"|"F32"', "pipeline/dtypes.py"),
    ("a dtype table", r'\{"(float32|bfloat16)": [\d{]', "pipeline/dtypes.py"),
    ("HF checkpoint file names", r'"tokenizer_config\.json"|"generation_config\.json"|"model\.safetensors\.index\.json"',
     "pipeline/checkpoint/hf_dir.py"),
    ("configs/models.toml's loader", r'"models\.toml"', "pipeline/run/expectation.py"),
    ("the pipeline's environment variables", r'"PIPELINE_\w+"',
     "pipeline/envvars.py"),
    ("the module every rank runs", r'"pipeline\.training\.entry"', "pipeline/launch/torchrun.py"),
    ("the chat and preference data files' names", r'"(chat|preference)(_eval)?\.jsonl"', "pipeline/data/dataset.py"),
    ("the pushed-image record's file name", r'"images\.json"', "pipeline/launch/pushed.py"),
]
SOURCES = sorted([*REPO.glob("pipeline/**/*.py"), *REPO.glob("bench/*.py"), *REPO.glob("bench/*.sh")])


@pytest.mark.parametrize("what, pattern, home", HOMES, ids=[h[0] for h in HOMES])
def test_each_fact_is_spelled_only_in_its_home(what, pattern, home):
    assert (REPO / home).exists(), f"{home}, the home of {what}, is gone"
    copies = [f"{path.relative_to(REPO)}:{n}: {line.strip()}" for path in SOURCES if path.relative_to(REPO).as_posix() != home
              for n, line in enumerate(path.read_text().splitlines(), 1)
              if re.search(pattern, line) and not line.lstrip().startswith("#")]
    assert not copies, f"{what} is spelled outside {home} (use its name from there):\n" + "\n".join(copies)


def test_the_check_finds_a_copy(tmp_path):
    """The scan is not vacuous: the patterns match the spellings they are meant to catch."""
    samples = {'"run.json"': 0, 'json.dumps(spec.to_dict(), indent=2)': 1, '"/opt/pipeline-venv/bin/python"': 2,
               'glob("/dev/neuron[0-9]*")': 3, '"NEURON_LOGICAL_NC_CONFIG"': 4, "NEURON_DEVICES = 16": 5,
               '{"F32": "float32"}': 6, '{"float32": 4, "bfloat16": 2}': 7, '("tokenizer_config.json",)': 8,
               'CONFIG_DIR / "models.toml"': 9, 'os.environ.get("PIPELINE_CHECKPOINTS")': 10,
               '["-m", "pipeline.training.entry"]': 11, 'data / "chat_eval.jsonl"': 12, 'root / "images.json"': 13}
    for sample, index in samples.items():
        assert re.search(HOMES[index][1], sample), (HOMES[index][0], sample)
