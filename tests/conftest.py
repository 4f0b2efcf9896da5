import os
import tempfile

import pytest
import torch

from big_memory import one_at_a_time
from hang_watchdog import ended_if_hung, limit_s, faulthandler_timeout_set

# The DSL caches compiled kernels on disk; keep test runs from writing to a shared folder.
os.environ.setdefault("CUTE_DSL_CACHE_DIR", tempfile.mkdtemp(prefix="cute_dsl_cache_"))
os.environ.setdefault("CUTE_FLASH_CACHE_DIR", tempfile.mkdtemp(prefix="cute_flash_cache_"))

try:
    from hypothesis import HealthCheck, settings

    # Derandomized: the same examples on every run, so that CI is reproducible; HYPOTHESIS_PROFILE=explore
    # draws new ones.
    settings.register_profile(
        "ci", max_examples=40, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
    )
    settings.register_profile("explore", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
except ImportError:  # hypothesis is in the test extra
    pass


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (run `pytest -m gpu` on a GPU machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _big_memory_tests_one_at_a_time(request):
    """Tests marked `big_memory` run one at a time across pytest-xdist's workers (`big_memory.py`)."""
    if request.node.get_closest_marker("big_memory") is None:
        yield
        return
    release = torch.cuda.empty_cache if torch.cuda.is_available() else None
    with one_at_a_time(os.environ.get("PYTEST_XDIST_TESTRUNUID"), release):
        yield


@pytest.fixture(autouse=True)
def _gpu_tests_end_if_hung(request, _big_memory_tests_one_at_a_time):
    """A GPU test still running after `hang_watchdog.limit_s()` (counted once it holds the
    `big_memory` lock, if it takes one) ends its process with every thread's stack on stderr.
    Not armed where pytest's own `-o faulthandler_timeout` is set (they would share one timer)."""
    if request.node.get_closest_marker("gpu") is None or faulthandler_timeout_set(request.config):
        yield
        return
    with ended_if_hung(limit_s()):
        yield
