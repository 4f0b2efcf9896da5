"""One `big_memory` test at a time across pytest-xdist's workers.

The tests past 4 GiB hold 10-40 GB of GPU memory each. Run side by side in several workers
(`pytest -m gpu -n 16` on an 80 GB card) they ran the card out of memory, and took small tests
of the other workers down with them; one at a time they pass. Each waits here for an exclusive
lock on a file that the workers of one run share (named by xdist's run id), and hands its cached
memory back to the driver before it lets the next one in.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile


def lock_path(run_id: str) -> str:
    """The lock file of the xdist run `run_id`, in the temp folder its workers share."""
    return os.path.join(tempfile.gettempdir(), f"cute_flash_big_memory_{run_id}.lock")


@contextlib.contextmanager
def one_at_a_time(run_id: str | None, release=None):
    """Hold the run's lock while the body runs (no lock without xdist: `run_id` None), then call
    `release` (the CUDA caching allocator's `empty_cache`) before unlocking."""
    if run_id is None:
        try:
            yield
        finally:
            if release is not None:
                release()
        return
    with open(lock_path(run_id), "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            try:
                if release is not None:
                    release()
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)
