"""pipeline/malloc.py: after retain_freed_memory_in_this_process(), a freed 256 MiB block stays with the process
for reuse; without it glibc hands the block back to the kernel at once."""

from __future__ import annotations

import os
import subprocess
import sys

from helpers import REPO
from pipeline import malloc

MIB = 2**20
# A child process: optionally the call, then RSS given back when a block of 256 MiB, every page written, is freed.
FREED_RSS = f"""
import sys
from pathlib import Path
from pipeline.malloc import retain_freed_memory_in_this_process
if sys.argv[1] == "retain":
    assert retain_freed_memory_in_this_process()
def rss():
    status = Path("/proc/self/status").read_text().splitlines()
    return int(next(line for line in status if line.startswith("VmRSS:")).split()[1]) * 1024
block = bytearray({256 * MIB})
memoryview(block)[::4096] = b"\\x01" * ({256 * MIB} // 4096)
held = rss()
del block
print(held - rss())
"""


def _rss_given_back(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k not in malloc.RETAIN_FREED_MEMORY}
    result = subprocess.run([sys.executable, "-c", FREED_RSS, mode], cwd=REPO, env=env, capture_output=True,
                            text=True, check=True)
    return int(result.stdout)


def test_the_freed_block_stays_with_the_process_only_after_the_call():
    assert _rss_given_back("default") > 200 * MIB
    assert _rss_given_back("retain") < 16 * MIB
