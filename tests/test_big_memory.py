"""The lock that runs the `big_memory` GPU tests one at a time across pytest-xdist's workers."""
from __future__ import annotations

import ast
import fcntl
import uuid
from pathlib import Path

import pytest

from big_memory import lock_path, one_at_a_time


def _held(run_id: str) -> bool:
    """Whether another open file of the run's lock file is refused the lock (flock locks conflict
    between open files of one process as between processes)."""
    with open(lock_path(run_id), "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def test_the_lock_is_held_through_the_body_and_the_release_and_let_go_after():
    run_id = uuid.uuid4().hex
    seen = []
    with one_at_a_time(run_id, release=lambda: seen.append(("release", _held(run_id)))):
        seen.append(("body", _held(run_id)))
    assert seen == [("body", True), ("release", True)]
    assert not _held(run_id)
    assert not _held(uuid.uuid4().hex)  # another run's workers have their own lock
    Path(lock_path(run_id)).unlink()


def test_a_failing_test_still_releases_its_memory_and_the_lock():
    run_id = uuid.uuid4().hex
    released = []
    with pytest.raises(RuntimeError, match="out of memory"):
        with one_at_a_time(run_id, release=lambda: released.append(True)):
            raise RuntimeError("CUDA out of memory")
    assert released == [True] and not _held(run_id)
    Path(lock_path(run_id)).unlink()


def test_without_xdist_there_is_no_lock_file_but_the_memory_is_released():
    released = []
    with one_at_a_time(None, release=lambda: released.append(True)):
        pass
    assert released == [True]
    assert not Path(lock_path("None")).exists()


def test_every_gpu_test_past_4_gib_is_marked_big_memory():
    """The tests whose names say they go past 4 GiB (or 2^31 elements) carry the marker."""
    big, unmarked = [], []
    for path in sorted((Path(__file__).parent / "gpu").glob("test_*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_") and (
                    "4gib" in node.name or "2_to_the_31" in node.name):
                big.append(node.name)
                if not any(ast.unparse(d) == "pytest.mark.big_memory" for d in node.decorator_list):
                    unmarked.append(f"{path.name}::{node.name}")
    assert len(big) >= 7 and unmarked == []
