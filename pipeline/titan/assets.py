"""torchtitan's test assets (tests/assets/tokenizer and c4_test), which AWS's torchtitan-neuron smoke
run trains with (awsdocs-neuron setup-torchtitan-neuron: config qwen3_8b_tp4_fsdp16_sac with
torchtitan's test tokenizer and c4_test from the repository).

torchtitan reads it relative to the working directory (Trainer.Config's default hf_assets_path
"./tests/assets/tokenizer"). The wheel does not ship it; a source checkout does, and
torchtitan-neuron is installed from one (`pip install -e .` in its clone, docs/sources.md), so the
installed package's checkout is looked in too, after the working directory, and the rank is given
the absolute path. Found without importing torchtitan (the launcher never imports it). `c4_test`
(tests/assets/c4_test) is found the same way (pipeline.data.dataset.titan_dataset_file).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from pipeline.errors import PipelineError

# TrainSettings.tokenizer → the test asset it names; "model" is the source checkpoint's own.
TOKENIZERS = {"titan-test": "tests/assets/tokenizer"}


def checkout_root() -> Path | None:
    """The source checkout the installed torchtitan package lives in (an editable install), or None."""
    spec = importlib.util.find_spec("torchtitan")
    if spec is None or not spec.origin:
        return None
    root = Path(spec.origin).resolve().parent.parent
    return root if (root / "tests" / "assets").is_dir() else None


def find(relative: str) -> Path | None:
    """tests/assets/… in the working directory, else in the installed torchtitan's checkout."""
    for base in (Path.cwd(), checkout_root()):
        if base is not None and (base / relative).exists():
            return (base / relative).resolve()
    return None


def tokenizer_dir(tokenizer: str, source_dir: str) -> str:
    """The directory torchtitan's HuggingFaceTokenizer reads for TrainSettings.tokenizer."""
    if tokenizer == "model":
        return source_dir
    found = find(TOKENIZERS[tokenizer])
    if found is None:
        raise PipelineError(f"tokenizer = {tokenizer!r} reads torchtitan's {TOKENIZERS[tokenizer]}, found neither in "
                            f"{Path.cwd()} nor in the installed torchtitan's source checkout.",
                            "run from a torchtitan checkout, install torchtitan from one (pip install -e), "
                            "or set tokenizer = \"model\".")
    return str(found)
