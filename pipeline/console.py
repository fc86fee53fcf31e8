"""What reaches the console: the verbosity (VERBOSE=1 shows everything), the filter the ranks' output goes
through (torchtitan's start-up log and the warnings every rank repeats are hidden, errors and tracebacks
never), and the training step line (step n/N, loss, tokens/s, ETA). Every hidden line stays in the run's
logs/ (torchrun's --tee writes each rank's whole output there)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from pipeline import envvars


def verbose() -> bool:
    """VERBOSE=1: every line of every rank and stage, unfiltered."""
    return os.environ.get(envvars.VERBOSE) == "1"


def brief() -> bool:
    """A stage run by `make pipeline`, whose end table reports its outcome: one line each, details on failure."""
    return os.environ.get(envvars.BRIEF) == "1" and not verbose()


def duration(seconds: float) -> str:
    """0:07, 12:03, 1:02:03."""
    seconds = max(0, round(seconds))
    hours, rest = divmod(seconds, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def step_line(step: int, total: int, loss: float, tokens_per_s: float, eta_s: float | None) -> str:
    """The line each training step prints (rank 0): where the run is, how it learns, how fast, how long to go."""
    where = f"{step:>{len(str(total))}}/{total}" if total else str(step)  # total 0: not known to the caller
    eta = "" if eta_s is None else f"  ETA {duration(eta_s)}"
    return f"step {where}  loss {loss:.6f}  {tokens_per_s:,.0f} tokens/s{eta}"


class StepClock:
    """The ETA of a run: the mean time of the steps this process logged after its first (which holds
    compilation and warm-up), times the steps left; from step 1 alone, step 1's own time."""

    def __init__(self, total: int):
        self.total = total
        self.first: tuple[int, float] | None = None  # (step, when it was logged)

    def eta(self, step: int, now: float, step_time_s: float) -> float | None:
        if not self.total:
            return None
        if self.first is None:
            self.first = (step, now)
            return step_time_s * (self.total - step)
        done = step - self.first[0]
        return (now - self.first[1]) / done * (self.total - step) if done > 0 else None


# ---- the ranks' output -----------------------------------------------------------------------------

@dataclass(frozen=True)
class Noise:
    """Output known to say nothing a user acts on, repeated by every rank of every run: hidden by default."""

    pattern: re.Pattern
    why: str
    follow: int = 0  # lines after it that belong to it (a Python warning's source line)


NOISE = (
    # torchtitan's get_peak_flops knows GPUs by name; on CPU (and trn2) the pipeline passes the target's own
    # peak instead (metrics peak_flops_per_rank), so the A100 fallback it warns about is never used.
    Noise(re.compile(r"Peak flops undefined for: \S+, fallback to A100"), "torchtitan's MFU peak lookup (the pipeline's own is used)"),
    Noise(re.compile(r"Error running lspci: .*fallback to use device_name"), "torchtitan's device-name lookup (no lspci)"),
    Noise(re.compile(r"ENV\[TORCH_NCCL_ASYNC_ERROR_HANDLING\] = \d+ will be overridden"), "torchtitan's NCCL default"),
    Noise(re.compile(r"UserWarning: DTensor (random operators|manual_seed\(\)) may not have complete support on cpu"),
          "torch's DTensor RNG note on CPU meshes", follow=1),
    Noise(re.compile(r"UserWarning: 'set_vital' is deprecated"), "torchdata's deprecated call", follow=1),
    # torchtitan's MoE router asks for a float32 autocast region, which CPU autocast does not support; it
    # computes in float32 either way.
    Noise(re.compile(r"UserWarning: In CPU autocast, but the target dtype is not supported"), "torchtitan's MoE on CPU",
          follow=2),
    Noise(re.compile(r"^Generating \w+ split: "), "Hugging Face datasets' cache progress"),
    # torchrun's banner when it sets OMP_NUM_THREADS=1 itself: the CPU target sets its own threads per rank.
    Noise(re.compile(r"^\*{20,}\s*$|^Setting OMP_NUM_THREADS environment variable for each process"), "torchrun's banner"),
)
RANK_PREFIX = re.compile(r"^\[(?:default)?rank\d+\]:")
TITAN_LOG = re.compile(r"^\[titan\] \S+ \S+ - \S+ - (DEBUG|INFO|WARNING|ERROR|CRITICAL) - ")
# Lines that always pass, whatever else they match: errors, a failed check, torchrun's failure summary.
ALWAYS = re.compile(r"\b(ERROR|CRITICAL|FAIL|FAILED)\b|^\s*error:|\b\w*(Error|Exception|Interrupt)\b(:|$)|"
                    r"Root Cause|exitcode|ChildFailedError|Traceback \(most recent call last\)")
# torchtitan's log lines a user wants at default verbosity too: a run resuming from one of its checkpoints, and
# which torchtitan API the ranks run on (pipeline.training.entry: the one line that tells the two apart).
TITAN_KEPT = re.compile(r"Loading the checkpoint from \S*/checkpoint/step-\d+|Training starts at step (?!1$)\d+"
                        r"|torchtitan API: \w+")
TRACEBACK = re.compile(r"Traceback \(most recent call last\)")
TRACEBACK_CONTINUES = re.compile(r"^\s|^During handling of the above exception|^The above exception was the direct cause|^$")


class RankOutputFilter:
    """Whether each line of one stream of torchrun's output reaches the console. A traceback passes
    whole (from its first line to the exception's); nothing is filtered when `everything` (VERBOSE=1)."""

    def __init__(self, everything: bool = False):
        self.everything = everything
        self.hidden = 0
        self._in_traceback = False
        self._follow = 0

    def passes(self, line: str) -> bool:
        if self.everything:
            return True
        text = RANK_PREFIX.sub("", line.rstrip("\r\n"), count=1)
        if self._in_traceback:
            self._in_traceback = bool(TRACEBACK_CONTINUES.match(text))  # its last line is the exception's
            return True
        if TRACEBACK.search(text):
            self._in_traceback = True
            return True
        if ALWAYS.search(text):
            self._follow = 0
            return True
        if self._follow:
            self._follow -= 1
            return self._hide()
        for noise in NOISE:
            if noise.pattern.search(text):
                self._follow = noise.follow
                return self._hide()
        level = TITAN_LOG.match(text)
        if (level and level.group(1) in ("DEBUG", "INFO") and not TITAN_KEPT.search(text)) or not text.strip():
            return self._hide()  # torchtitan's start-up and save log: in logs/, the step line says the rest
        return True

    def _hide(self) -> bool:
        self.hidden += 1
        return False
