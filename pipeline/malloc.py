"""glibc's allocator, told to keep freed memory for reuse: for processes that train the embedded models on CPU."""

from __future__ import annotations

# glibc returns a freed block of more than 32 MiB (its largest dynamic mmap threshold) to the
# kernel at once, so the tensors of every step over the 151936-word vocabulary (logits, their
# log-softmax and gradients: 150 MB each at batch 2 × 128) are faulted in afresh, zeroed by the
# kernel, every step. Raising the thresholds keeps freed memory for reuse: measured on the tiny
# model, one process, 2 threads, the settings alternating, 4 rounds on a busy 2-core machine:
# 0.7–1.3 s CPU per step with them, 1.4–2.7 s without (1.4–3.2× within each round); at 512 MiB
# they lose the gain, and glibc's transparent-huge-page tunable (glibc.malloc.hugetlb=1) does not
# help. What they keep is also never given back: a Qwen3-0.6B-shaped model at the CPU defaults
# peaked about 1 GiB higher per rank with them and was killed on a 24 GiB machine; without them
# it trains (10.7 GiB per rank).
RETAIN_FREED_MEMORY = {"MALLOC_MMAP_THRESHOLD_": "4294967296", "MALLOC_TRIM_THRESHOLD_": "4294967296"}


def retain_freed_memory_in_this_process() -> bool:
    """RETAIN_FREED_MEMORY for this process, from now on: glibc reads the variables only as a process starts,
    mallopt(3) sets the same two thresholds later (its argument is an int: 2 GiB, above every block the
    embedded models free). False where the C library has no mallopt (not glibc); nothing changes then."""
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except AttributeError:
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's <malloc.h>
    largest_int = 2**31 - 1
    return bool(mallopt(m_trim_threshold, largest_int)) and bool(mallopt(m_mmap_threshold, largest_int))
