"""What a user reads of an outcome: the one exception type, and a named check in a table."""

from dataclasses import dataclass


class PipelineError(Exception):
    """A problem the user can fix: printed as one line, exit status 2, no traceback."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} Fix: {fix}" if fix else problem)


@dataclass(frozen=True)
class Check:
    """One row of a verdict (verify, the rehearsal): what was checked, whether it passed, and the numbers."""

    name: str
    passed: bool
    detail: str
