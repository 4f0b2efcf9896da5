"""One `big_memory` test at a time across pytest-xdist's workers.

The tests past 4 GiB hold several GB of GPU memory each (k and v alone 4-6 GiB apiece). In a run
of `pytest -m gpu -n 16` on an 80 GB card, three of them and four small tests running beside them
failed, and two of those passed when run again alone: most likely the workers held more memory at
once than the card has. Each waits here for an exclusive lock on a file that the workers of one
run share (named by xdist's run id; the empty file stays in the temp folder), and hands its cached
memory back to the driver before it lets the next one in. With the lock, the whole suite under
`-n 16` on that card passed, these tests included.
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
    `release` (the CUDA caching allocator's `empty_cache`) before unlocking, even if the body raised."""
    with contextlib.ExitStack() as stack:  # its callbacks run last in, first out
        if run_id is not None:
            f = stack.enter_context(open(lock_path(run_id), "a"))
            fcntl.flock(f, fcntl.LOCK_EX)
            stack.callback(fcntl.flock, f, fcntl.LOCK_UN)
        if release is not None:
            stack.callback(release)
        yield
