"""A model's expected step-1 loss and the conditions it was measured under (configs/models.toml).

A step-1 loss depends on the data, the tokenizer, the sequence length and the precision as much
as on the weights, so an expectation is compared only with a run made under the same settings;
otherwise verify says "not comparable" and names the settings that differ. Each condition says
what it rests on: `source` (the source states it), `assumed` (inferred, with the reason in `note`)
or `unknown` (no source says; then it is not compared, and verify says so). The loading verdict
itself never rests on this: verify recomputes the step-1 loss with plain transformers.
No torch imports here.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, fields

from pipeline.errors import PipelineError
from pipeline.run import settings as settings_mod
from pipeline.run.settings import CONFIG_DIR, TrainSettings

MODELS_TOML = CONFIG_DIR / "models.toml"
# The settings a step-1 loss depends on besides the weights (their fields say `condition`).
CONDITION_SETTINGS = settings_mod.named("condition")
BASES = ("source", "assumed", "unknown")


@dataclass(frozen=True)
class Condition:
    setting: str
    value: object  # None when unknown
    basis: str
    note: str = ""

    def describe(self) -> str:
        return f"{self.setting} {'unknown' if self.basis == 'unknown' else repr(self.value)} ({self.basis})"


@dataclass(frozen=True)
class Comparison:
    differing: dict  # setting → (the run's value, the expectation's)
    unknown: tuple[str, ...]
    assumed: tuple[str, ...]

    @property
    def comparable(self) -> bool:
        return not self.differing


@dataclass(frozen=True)
class Step1Expectation:
    model: str
    loss: float
    tolerance: float
    source: str
    conditions: tuple[Condition, ...]

    def compare(self, settings: TrainSettings) -> Comparison:
        differing = {c.setting: (getattr(settings, c.setting), c.value) for c in self.conditions
                     if c.basis != "unknown" and getattr(settings, c.setting) != c.value}
        return Comparison(differing,
                          tuple(c.setting for c in self.conditions if c.basis == "unknown"),
                          tuple(c.setting for c in self.conditions if c.basis == "assumed"))

    def to_dict(self) -> dict:
        return {"model": self.model, "loss": self.loss, "tolerance": self.tolerance, "source": self.source,
                "conditions": {c.setting: {"value": c.value, "basis": c.basis, "note": c.note} for c in self.conditions}}


def known_models() -> dict:
    """configs/models.toml: per Hub model, its pinned revision and expected step-1 loss."""
    return tomllib.loads(MODELS_TOML.read_text())


def load(model: str | None, text: str | None = None) -> Step1Expectation | None:
    """models.toml's [<model>.expected_step1] (None when it has none); malformed → PipelineError."""
    data = tomllib.loads(text) if text is not None else known_models()
    table = data.get(model or "", {}).get("expected_step1")
    if table is None:
        return None
    where = f"{MODELS_TOML} [{model!r}.expected_step1]"
    fix = "give loss, tolerance, source and a [conditions] entry { value, basis, note } for each of " \
          f"{', '.join(CONDITION_SETTINGS)}."
    try:
        loss, tolerance, source, given = float(table["loss"]), float(table["tolerance"]), str(table["source"]), table["conditions"]
    except (KeyError, TypeError, ValueError) as err:
        raise PipelineError(f"{where} is incomplete ({err}).", fix) from err
    if set(given) != set(CONDITION_SETTINGS):
        raise PipelineError(f"{where}: conditions {sorted(given)}, expected exactly {list(CONDITION_SETTINGS)}.", fix)
    types = {f.name: f.type for f in fields(TrainSettings)}
    conditions = []
    for setting in given:  # in the file's order (the check above: exactly CONDITION_SETTINGS)
        entry = given[setting]
        basis = entry.get("basis")
        if basis not in BASES:
            raise PipelineError(f"{where}: {setting}.basis is {basis!r}, not one of {', '.join(BASES)}.", fix)
        value = entry.get("value")
        if (value is None) != (basis == "unknown"):
            raise PipelineError(f"{where}: {setting} has basis {basis!r} and value {value!r}; a value is given "
                                "exactly when the basis is not unknown.", fix)
        if value is not None and type(value).__name__ != types[setting]:
            raise PipelineError(f"{where}: {setting} = {value!r} is not a {types[setting]} (TrainSettings.{setting}).", fix)
        conditions.append(Condition(setting, value, basis, str(entry.get("note", ""))))
    return Step1Expectation(model, loss, tolerance, source, tuple(conditions))
