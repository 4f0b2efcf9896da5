"""The watchdog that ends a GPU test's process when the test hangs (`hang_watchdog.py`)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from hang_watchdog import DEFAULT_LIMIT_S, limit_s, faulthandler_timeout_set

TESTS = Path(__file__).parent


def _child(body: str) -> tuple[subprocess.CompletedProcess, float]:
    script = "import sys, time\nsys.path.insert(0, %r)\nfrom hang_watchdog import ended_if_hung\n" % str(TESTS)
    start = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script + textwrap.dedent(body)], capture_output=True, text=True,
                          timeout=60)
    return done, time.monotonic() - start


def test_a_body_past_its_limit_ends_the_process_with_its_stack():
    done, took = _child("""
        def stuck_in_the_driver():
            time.sleep(30)
        with ended_if_hung(0.5):
            stuck_in_the_driver()
        print("not reached")
    """)
    assert done.returncode == 1
    assert "not reached" not in done.stdout
    assert "Timeout" in done.stderr and "stuck_in_the_driver" in done.stderr
    assert took < 20


def test_a_body_within_its_limit_leaves_nothing_armed():
    done, _ = _child("""
        with ended_if_hung(0.5):
            pass
        time.sleep(1.5)  # past the limit, outside the body
        print("finished")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished" and done.stderr == ""


def test_an_exception_in_the_body_also_disarms_it():
    done, _ = _child("""
        try:
            with ended_if_hung(0.5):
                raise RuntimeError("a failing test")
        except RuntimeError:
            pass
        time.sleep(1.5)
        print("finished")
    """)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "finished"


def test_the_limit_comes_from_the_environment(monkeypatch):
    monkeypatch.delenv("CUTE_FLASH_GPU_TEST_LIMIT_S", raising=False)
    assert limit_s() == DEFAULT_LIMIT_S
    monkeypatch.setenv("CUTE_FLASH_GPU_TEST_LIMIT_S", "42.5")
    assert limit_s() == 42.5


class _Config:
    def __init__(self, ini):
        self.ini = ini

    def getini(self, name):
        if name not in self.ini:
            raise ValueError(f"unknown configuration value: {name!r}")
        return self.ini[name]


def test_it_stands_aside_where_pytests_own_faulthandler_timeout_is_set():
    """One `faulthandler` timer per process: with pytest's `-o faulthandler_timeout=N` (N > 0) the
    watchdog is not armed, so pytest's dump keeps its timer through the test's teardown."""
    assert faulthandler_timeout_set(_Config({"faulthandler_timeout": "150"}))
    assert faulthandler_timeout_set(_Config({"faulthandler_timeout": 0.5}))
    assert not faulthandler_timeout_set(_Config({"faulthandler_timeout": 0.0}))  # pytest's default
    assert not faulthandler_timeout_set(_Config({"faulthandler_timeout": ""}))
    assert not faulthandler_timeout_set(_Config({}))  # -p no:faulthandler



@pytest.mark.parametrize("option,expected", [([], False), (["-o", "faulthandler_timeout=7"], True),
                                             (["-p", "no:faulthandler"], False)])
def test_it_reads_the_option_pytest_itself_registers(tmp_path, option, expected):
    """The same check in a pytest run of its own, with and without the option (and without the plugin)."""
    (tmp_path / "test_child.py").write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(TESTS)!r})
        from hang_watchdog import faulthandler_timeout_set

        def test_option(pytestconfig):
            assert faulthandler_timeout_set(pytestconfig) is {expected}
    """))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *option, "test_child.py"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
