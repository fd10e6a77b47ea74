import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def tiny_model(tmp_path):
    """The project's tiny random Qwen3 (real.tiny), built in the test's own folder."""
    from real.tiny import make_tiny_model

    return make_tiny_model(tmp_path / "tiny")


# --- Two workers, and the tests that time real work alone -------------------------------------
# The suite runs on two pytest-xdist workers (pyproject's addopts: ``-n 2 --dist loadfile``). A test
# marked ``alone`` measures wall time (nodus calibrate on the CPU compares a process alone against two
# at once, and refuses timings that read the co-run faster than alone): the other worker's tests would
# slow one side of its measurement. Under xdist every test holds a shared lock while it runs (setup,
# call and teardown); an ``alone`` test holds it exclusively, and first takes a turnstile that every
# test passes through, so the other worker stops at its next test instead of starving the waiting
# one. Without xdist (``-n 0``) the hook does nothing.

def _lock_dir():
    import os
    import tempfile

    uid = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if not uid or not os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    d = Path(tempfile.gettempdir()) / f"nodus-pytest-{uid}"
    d.mkdir(exist_ok=True)
    return d


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    d = _lock_dir()
    if d is None:
        yield
        return
    import fcntl

    alone = item.get_closest_marker("alone") is not None
    with open(d / "turnstile", "a+") as turn, open(d / "running", "a+") as running:
        fcntl.flock(turn, fcntl.LOCK_EX)
        fcntl.flock(running, fcntl.LOCK_EX if alone else fcntl.LOCK_SH)
        if not alone:
            fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(running, fcntl.LOCK_UN)
            if alone:
                fcntl.flock(turn, fcntl.LOCK_UN)
