"""tests/conftest.py's lock under pytest-xdist: a test marked ``alone`` runs with no other worker's
test beside it, and the other tests still run two at once."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("xdist")

_TIMED = """
import json, os, time
from pathlib import Path

import pytest

def _record(tag):
    t0 = time.time()
    time.sleep({sleep})
    with open(Path({log!r}) / f"{{tag}}-{{os.environ.get('PYTEST_XDIST_WORKER')}}-{{t0}}", "w") as f:
        json.dump([t0, time.time()], f)
"""


def _write(path, sleep, log, tests):
    path.write_text(_TIMED.format(sleep=sleep, log=str(log)) + "".join(tests))


def _intervals(log, prefix):
    return [json.loads(p.read_text()) for p in log.iterdir() if p.name.startswith(prefix)]


def _overlap(a, b):
    return a[0] < b[1] and b[0] < a[1]


def _suite(tmp_path, alone_tests):
    """A suite with tests/conftest.py, run on two xdist workers (a file a worker, the largest first):
    ``alone_tests`` alone tests (0.5 s each) in one file, two files of three plain ones (0.3 s each).
    The intervals each kind ran in."""
    root, log = tmp_path / "suite", tmp_path / "log"
    root.mkdir(), log.mkdir()
    shutil.copy(Path(__file__).parent / "conftest.py", root / "conftest.py")
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    alone: times real work\n")
    if alone_tests:
        _write(root / "test_a.py", 0.5, log,
               [f"\n@pytest.mark.alone\ndef test_alone_{i}():\n    _record('alone')\n" for i in range(alone_tests)])
    for name in ("b", "c"):
        _write(root / f"test_{name}.py", 0.3, log,
               [f"\ndef test_{name}_{i}():\n    _record('plain')\n" for i in range(3)])
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadfile", "-p", "no:cacheprovider",
                        str(root)], cwd=root, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    return _intervals(log, "alone"), _intervals(log, "plain")


def test_an_alone_test_runs_with_no_other_test_beside_it(tmp_path):
    alone, plain = _suite(tmp_path, alone_tests=4)
    assert len(alone) == 4 and len(plain) == 6
    for a in alone:
        assert not [p for p in plain if _overlap(a, p)], (a, sorted(plain))


def test_tests_not_alone_still_run_two_at_once(tmp_path):
    alone, plain = _suite(tmp_path, alone_tests=0)
    assert not alone and len(plain) == 6
    assert any(_overlap(p, q) for i, p in enumerate(plain) for q in plain[i + 1:]), sorted(plain)
