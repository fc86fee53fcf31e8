"""pipeline/flags.py: a stage's command line is its dataclass's flag fields, so a new field is a new
flag of every stage that takes the dataclass, with nothing else to edit."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from pipeline import flags
from pipeline.flags import flag


@dataclass(frozen=True)
class Request:
    name: str = flag(None, "the name", required=True)
    count: int | None = flag(None, "how many")
    where: Path | None = flag(None, "a directory")
    mode: str = flag("fast", "how", choices=("fast", "slow"))
    extra: tuple[str, ...] = flag((), "shell words", words=True)
    loud: bool = flag(False, "say more")
    secret: bool = flag(False, "not listed", hidden=True)
    internal: int = 3  # no help: not a flag
    listed: dict = field(default_factory=dict)


def parse(argv: list[str], **kw) -> argparse.Namespace:
    parser = argparse.ArgumentParser(allow_abbrev=False)
    flags.add_flags(parser, Request, **kw)
    return parser.parse_args(argv)


def test_each_flag_field_becomes_a_typed_flag():
    args = parse(["--name", "x", "--count", "3", "--where", "/tmp", "--mode", "slow", "--extra", "--a 1 'b c'",
                  "--loud", "--secret"])
    assert flags.values(Request, args) == {"name": "x", "count": 3, "where": Path("/tmp"), "mode": "slow",
                                           "extra": ("--a", "1", "b c"), "loud": True, "secret": True}
    assert not hasattr(args, "internal") and not hasattr(args, "listed")
    assert Request(**flags.values(Request, args)).extra == ("--a", "1", "b c")


def test_defaults_required_and_choices_hold():
    assert flags.values(Request, parse(["--name", "x"])) == {"name": "x", "count": None, "where": None, "mode": "fast",
                                                             "extra": (), "loud": False, "secret": False}
    with pytest.raises(SystemExit):
        parse([])  # --name is required
    with pytest.raises(SystemExit):
        parse(["--name", "x", "--mode", "medium"])
    with pytest.raises(SystemExit):
        parse(["--name", "x", "--mode", "fast"], choices={"mode": ("slow",)})  # choices known at run time win


def test_unset_default_tells_given_from_not_given():
    args = parse(["--name", "x", "--count", "0"], unset_default=True)
    assert flags.values(Request, args, given_only=True) == {"name": "x", "count": 0}


def test_a_settings_field_with_help_is_a_flag_of_train_and_launch():
    """TrainSettings' flag fields reach both stages' command lines, under their own names."""
    from pipeline.run.settings import TrainSettings
    from pipeline.stages import launch, train
    from pipeline.training.resolve import RunRequest

    settings_flags = {"--" + f.name.replace("_", "-") for f in flags.flag_fields(TrainSettings)}
    assert {"--steps", "--seq-len", "--nproc-per-node", "--dataset"} <= settings_flags
    for stage in (train, launch):
        parser = argparse.ArgumentParser(allow_abbrev=False)
        stage.add_arguments(parser)
        assert settings_flags <= set(parser._option_string_actions), stage.__name__
    parser = argparse.ArgumentParser(allow_abbrev=False)
    train.add_arguments(parser)
    request = RunRequest.from_args(parser.parse_args(["--model", "tiny", "--path", "native", "--steps", "3"]))
    assert request.flags == {"steps": 3} and request.model == "tiny" and request.titan_args == ()


def test_unclosed_quotes_in_words_are_one_line_naming_the_flag():
    from pipeline.errors import PipelineError

    with pytest.raises(PipelineError, match=r"--extra .*cannot be split.*Fix: close its quotes"):
        flags.values(Request, parse(["--name", "x", "--extra", "'unclosed"]))
