"""glibc's malloc thresholds pinned for the benchmarks' steps (bench/overhead.py): one heap
that every step reuses. A module of its own, so that a process that wants only this imports
nothing else."""

import ctypes


def pin_malloc() -> str:
    """Serve every allocation from one heap that is never trimmed (glibc: no mmap, whatever the
    size; no trim below 1 GiB), so that every mode reuses warm pages. By default glibc moves its
    mmap threshold as blocks are freed, so which of a step's large temporaries get fresh pages,
    and pay a page fault per 4 KiB, depends on what else the step allocated: with glibc's
    defaults an unprotected step took 14,096 page faults to a protected one's 8,128, and the
    step grew 1.4 points less than its checks took (docs/runs.md, run 14). The threshold
    cannot be pinned above 32 MiB, so blocks of that size and more (the scores from sequence
    1024 on) are kept off mmap altogether. Returns what was done."""
    m_trim_threshold, m_mmap_max = -1, -4  # glibc's malloc.h
    try:
        libc = ctypes.CDLL("libc.so.6")
        pinned = libc.mallopt(m_mmap_max, 0) and libc.mallopt(m_trim_threshold, 1 << 30)
    except (OSError, AttributeError):
        pinned = 0
    return "glibc thresholds pinned" if pinned else "default (not glibc)"
