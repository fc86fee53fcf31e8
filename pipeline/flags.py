"""Command lines generated from dataclasses: a field with help in its metadata is a `--flag`, so a
knob is declared once, as a field, and every stage that takes that dataclass takes its flag.

Metadata keys: help (the field is a flag only with it), required, choices, words (a string on the
command line, split like a shell into the field's tuple), hidden (accepted, not listed in --help),
default (a stage's own default for a field declared elsewhere: given through `overrides`, it makes
the flag optional).

The Make interface is generated from the same fields (pipeline.host.makevars writes make/variables.mk):
make (the Make variable that gives the flag), make_default (the default `make help` shows when it is not
the field's own: "detected", or "$(MODEL)" for a default the Makefile computes), make_help (what the
variable means in Make, where it does more than this flag), make_assigns (Make assigns the field's
default, `X ?= default`, for the stages that need a value; the flag is passed only when the user gives X).
A required field with no make_default is always passed, as `--flag=value`: the stage's own check names an
unset value (HUB_REPO).
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path

from pipeline.errors import PipelineError

# Annotation (as a string: `from __future__ import annotations`) → argparse type.
_TYPES = {"str": str, "int": int, "float": float, "Path": Path}


def flag(default=None, help: str = "", **metadata):  # noqa: A002 - argparse's own word
    """A dataclass field that is also a command-line flag."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"help": help, **metadata})
    return dataclasses.field(default=default, metadata={"help": help, **metadata})


def flag_fields(cls, only: tuple[str, ...] | None = None) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata and (only is None or f.name in only)]


def add_flags(parser: argparse.ArgumentParser, cls, choices: dict | None = None, unset_default: bool = False,
              only: tuple[str, ...] | None = None, overrides: dict[str, dict] | None = None) -> None:
    """One flag per flag field of `cls`. `choices`: per field, known only at run time (the registry's
    paths). `unset_default`: every flag defaults to None, "not given" (the config files decide).
    `only`: just these fields (a stage that needs only MODEL of the run address). `overrides`: per
    field, metadata over the declared one (a stage's own default, choices or required)."""
    for f in flag_fields(cls, only):
        override = (overrides or {}).get(f.name, {})
        meta = {**f.metadata, **override, **({"required": False} if "default" in override else {})}
        kind = str(f.type).replace(" | None", "").strip()
        options: dict = {"help": argparse.SUPPRESS if meta.get("hidden") else meta["help"], "dest": f.name}
        if kind == "bool":
            options["action"] = "store_true"
        else:
            options["type"] = str if meta.get("words") else _TYPES[kind]
            if (choices or {}).get(f.name) or meta.get("choices"):
                options["choices"] = tuple((choices or {}).get(f.name) or meta["choices"])
            options["required"] = bool(meta.get("required"))
        if unset_default:
            options["default"] = None
        elif "default" in meta or (f.default is not dataclasses.MISSING and not meta.get("required")):
            default = meta.get("default", f.default)
            options["default"] = shlex.join(default) if meta.get("words") else default
        parser.add_argument("--" + f.name.replace("_", "-"), **options)


def values(cls, args: argparse.Namespace, given_only: bool = False, only: tuple[str, ...] | None = None) -> dict:
    """The flag fields' values from parsed `args` (words split into tuples); `given_only`: those not None;
    `only`: as add_flags was given it."""
    out = {}
    for f in flag_fields(cls, only):
        value = getattr(args, f.name)
        if f.metadata.get("words") and isinstance(value, str):
            try:
                value = tuple(shlex.split(value))
            except ValueError as err:  # an unclosed quote
                flag_name = "--" + f.name.replace("_", "-")
                raise PipelineError(f"{flag_name} {value!r} cannot be split into words ({err}).",
                                    "close its quotes (the value is split as a shell would).") from err
        if not (given_only and value is None):
            out[f.name] = value
    return out
