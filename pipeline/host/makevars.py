"""The Make interface, generated: make/variables.mk holds the VARIABLES table (`make help` prints it, the
Makefile refuses a command-line variable missing from it) and, per dataclass, the flags string that passes
its fields' Make variables to a stage. A knob with a Make variable is a field with `make` in its metadata
(pipeline.flags) and its use in the code; the Makefile is targets and dependencies.

`python -m pipeline makevars` writes the file; tests/project/test_project_makevars.py fails while the
committed one differs from what the fields give.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from pipeline.flags import flag_fields
from pipeline.fsutil import atomic_write_text
from pipeline.run.ref import RunRef
from pipeline.run.settings import TrainSettings
from pipeline.launch.cluster import LaunchRequest
from pipeline.training.resolve import RunRequest
from pipeline.data.user_data import DataRequest
from pipeline.outputs.export import ExportRequest
from pipeline.outputs.harness import EvalRequest
from pipeline.outputs.publish import PublishRequest
from pipeline.outputs.serve import GenerateRequest, ServeRequest
from pipeline.outputs.verify import VerifyRequest

OUTPUT = Path(__file__).resolve().parents[2] / "make" / "variables.mk"
COMMAND = "python -m pipeline makevars"

# Make variable holding the flags → (dataclass, its fields) whose Make variables it passes, as the stage
# takes them with pipeline.flags.add_flags; None: the fields the class declares itself (RunRequest's run
# address is RunRef's, RUN_FLAGS). A variable's row comes from the first string that passes it: a variable
# several stages take (FORCE, DRY_RUN, ADAPTER) is declared with its Make meaning where it first appears.
FLAG_STRINGS = {
    "RUN_FLAGS": ((RunRef, None),),
    "TRAIN_FLAGS": ((RunRequest, None), (TrainSettings, None)),
    "LAUNCH_FLAGS": ((LaunchRequest, None),),
    "DATA_FLAGS": ((RunRequest, ("model", "config", "target")), (TrainSettings, ("dataset", "seq_len")),
                   (DataRequest, None)),
    "EXPORT_FLAGS": ((ExportRequest, None),),
    "VERIFY_FLAGS": ((VerifyRequest, None),),
    "EVAL_FLAGS": ((EvalRequest, None),),
    "PUBLISH_FLAGS": ((PublishRequest, None),),
    "SERVE_FLAGS": ((ServeRequest, None),),
    "GENERATE_FLAGS": ((GenerateRequest, None), (ServeRequest, ("max_model_len", "kv_cache_gib", "compile", "vllm"))),
    "REPORT_FLAGS": ((RunRef, ("model",)),),
}
# An unset TrainSettings variable leaves the value to configs/<target>.toml and CONFIG=.
CONFIG_DECIDES = (TrainSettings,)

# Variables that are no dataclass field (yet): Make's own (which venv, which models `make pipeline` runs),
# and the flags of stages whose parsers are written by hand (push, image, pin).
# (name, default as `make help` shows it, meaning)
MAKE_ONLY = (
    ("MODELS", "tiny tiny-moe", "pipeline: the models it runs (space-separated MODEL values)"),
    ("PATHS", "every path", "pipeline: the training paths it runs (space-separated)"),
    ("IN_CONTAINER", "$(IN_CONTAINER)", "1: run stages inside the pipeline image (default 1 on a Neuron host whose "
     "venv lacks torch-neuronx)"),
    ("BASE_IMAGE", "Neuron 2.33 DLC", "the image `make image` builds on"),
    ("REGISTRY", "", "push: registry/repository to push the image to (e.g. "
     "<account>.dkr.ecr.<region>.amazonaws.com/qwen3)"),
    ("VERBOSE", "0", "1: every command and every line of the ranks' output (default: torchtitan's start-up log and "
     "repeated warnings hidden, errors never)"),
    ("BENCH_REPEATS", "2", "bench: repeats per measurement"),
    ("BENCH_ONLY", "all", "bench: comma-separated sections"),
    ("PYTHON", "$(PYTHON)", "the Python that builds .venv (3.11 or newer)"),
    ("VENV", "$(VENV)", "the virtual environment"),
    ("VLLM_VENV", "$(VLLM_VENV)", "where `make setup-vllm` builds vLLM's venv (serve and generate use it unless VLLM is "
     "given)"),
    ("TITAN_MAIN_WHEEL", "$(TITAN_MAIN_WHEEL)", "test-titan-main, test-titan-sim: a wheel of upstream torchtitan "
     "main (docs/sources.md)"),
    ("TEST_WORKERS", "$(TEST_WORKERS)", "test, test-titan-main, test-titan-sim: pytest-xdist worker processes "
     "(1: one)"),
)
# Those of them that are on/off (1/0, true/false, yes/no); a bool field's variable is on/off by its type.
MAKE_ONLY_ON_OFF = ("IN_CONTAINER", "VERBOSE")


@dataclasses.dataclass(frozen=True)
class MakeVar:
    """One Make variable of a dataclass field: its row in VARIABLES and the words it adds to a stage's command."""

    name: str
    default: str  # as `make help` shows it; "$(NAME)": Make gives it a value (it is never empty)
    meaning: str
    flag: str  # the Make text passing the field's flag

    @property
    def row(self) -> str:
        return f"{self.name}|{self.default}|{self.meaning}"


def _make_fields(cls, names: tuple[str, ...] | None) -> list[dataclasses.Field]:
    """The flag fields of `cls` with a Make variable: `names`, or those `cls` declares itself."""
    inherited = {f.name for base in cls.__mro__[1:] if dataclasses.is_dataclass(base) for f in dataclasses.fields(base)}
    return [f for f in flag_fields(cls, names) if "make" in f.metadata and (names or f.name not in inherited)]


def _fields() -> list[tuple[str, type, dataclasses.Field]]:
    """(flags string, class, field) for every Make variable a string passes, in order."""
    return [(string, cls, f) for string, selected in FLAG_STRINGS.items() for cls, names in selected
            for f in _make_fields(cls, names)]


def make_var(cls, field: dataclasses.Field) -> MakeVar:
    meta = field.metadata
    name, option = meta["make"], "--" + field.name.replace("_", "-")
    value = f"$(call q,$({name}))"
    kind = str(field.type)
    if kind == "bool":
        default, flag = "0", f"$(if $(call on,{name}),{option})"
    elif meta.get("required") and "make_default" not in meta:
        # Always passed, as one `--flag=value` word: the stage's own check names an unset (or odd) value (HUB_REPO).
        default, flag = "", f"{option}={value}"
    elif meta.get("required"):
        # Always passed: a Make default the Makefile computes (MODEL), or one that fills an unset value (NODES).
        default = meta["make_default"]
        flag = f"{option} {value}" if default.startswith("$(") else f"{option} $(call q,$(or $({name}),{default}))"
    elif meta.get("make_assigns"):
        # Make holds the default for the stages that need a value; this stage has its own, so only a given one.
        default, flag = f"$({name})", f"$(if $(filter-out default file,$(origin {name})),{option} {value})"
    else:
        # words: one `--flag=value` word, since the value itself starts with `--` (TITAN_ARGS)
        shown = "config" if cls in CONFIG_DECIDES else "" if field.default in (None, ()) else str(field.default)
        default = meta.get("make_default", shown)
        flag = f"$(if $({name}),{option}{'=' if meta.get('words') else ' '}{value})"
    return MakeVar(name, default, meta.get("make_help", meta["help"]), flag)


def make_vars() -> dict[str, list[MakeVar]]:
    """Flags string name → the Make variables of its dataclasses' fields, in field order."""
    strings: dict[str, list[MakeVar]] = {string: [] for string in FLAG_STRINGS}
    for string, cls, f in _fields():
        strings[string].append(make_var(cls, f))
    return strings


def assignments() -> list[str]:
    """`NAME ?= default` for the fields Make assigns (make_assigns)."""
    return list(dict.fromkeys(f"{f.metadata['make']} ?= {f.default}" for _, _, f in _fields()
                              if f.metadata.get("make_assigns")))


def render() -> str:
    strings = make_vars()
    first: dict[str, str] = {}  # variable → its row, from the first string that passes it
    for found in strings.values():
        for v in found:
            first.setdefault(v.name, v.row)
    rows = list(first.values()) + ["|".join(row) for row in MAKE_ONLY]
    names = [row.split("|")[0] for row in rows]
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise ValueError(f"Make variables declared twice: {', '.join(duplicated)}")
    lines = [f"# Generated by `{COMMAND}` (pipeline/host/makevars.py) from the dataclasses' fields; do not edit.",
             *assignments(),
             "# name|default|meaning: `make help` prints it, and a command-line variable missing from it is refused.",
             "define VARIABLES", *rows, "endef",
             "# Variables whose default is a value: the user may not give them empty.",
             "DEFAULTED_VARS := " + " ".join(n for n, row in zip(names, rows) if row.split("|")[1] == f"$({n})"),
             "BOOL_VARS := " + " ".join([*dict.fromkeys(f.metadata["make"] for _, _, f in _fields() if str(f.type) == "bool"),
                                         *MAKE_ONLY_ON_OFF])]
    for string, found in strings.items():
        lines.append(f"{string} = " + " \\\n  ".join(v.flag for v in found))
    return "\n".join(lines) + "\n"


def write(path: Path = OUTPUT) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, render())
    return path
