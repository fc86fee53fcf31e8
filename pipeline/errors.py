"""The one exception type a user is meant to read."""


class PipelineError(Exception):
    """A problem the user can fix: printed as one line, exit status 2, no traceback."""

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem} Fix: {fix}" if fix else problem)
