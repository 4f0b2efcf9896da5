"""End a GPU test's process when the test runs past a time limit.

A kernel that never finishes (a pipeline whose consumer never releases a stage, say) does not
fail: the host blocks at the next call that waits for the GPU, and the whole run stops at its
wall-clock limit with nothing reported for that test or any after it on the same worker. Past the
limit this dumps every thread's stack to stderr and ends the process with status 1 (Python's
`faulthandler`, which works while the main thread is blocked in the driver): under pytest-xdist
the worker's test is reported as failed ("worker crashed") and a new worker takes the rest.
"""
from __future__ import annotations

import contextlib
import faulthandler
import os

# Seconds a GPU test may take, compiles included; `CUTE_FLASH_GPU_TEST_LIMIT_S` overrides it. No
# test of a whole `-n 16` run on an H100 reached the 240 s per-test timeout that run was given.
DEFAULT_LIMIT_S = 300.0


def limit_s() -> float:
    return float(os.environ.get("CUTE_FLASH_GPU_TEST_LIMIT_S", DEFAULT_LIMIT_S))


def faulthandler_timeout_set(config) -> bool:
    """Whether pytest's own `faulthandler_timeout` is set for this run. The process has one
    `faulthandler` timer, which that option arms around each test; the watchdog stands aside
    then, rather than replace pytest's timer with its own and disarm it for the test's teardown."""
    try:
        return float(config.getini("faulthandler_timeout") or 0) > 0
    except ValueError:  # the option is not registered: pytest's faulthandler plugin is off
        return False


@contextlib.contextmanager
def ended_if_hung(limit: float):
    """Dump the stacks and end the process if the body is still running after `limit` seconds."""
    faulthandler.dump_traceback_later(limit, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
