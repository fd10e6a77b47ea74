import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def tiny_model(tmp_path):
    """The project's tiny random Qwen3 (real.tiny), built in the test's own folder."""
    from real.tiny import make_tiny_model

    return make_tiny_model(tmp_path / "tiny")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Under pytest-xdist (``-n 2 --dist loadgroup``, pyproject's addopts) each worker builds the
    module-scoped fixtures of the tests it runs: a test using one (a pooled engine and trainer, a
    recorded run; 60-80 s to build on 2 cores) joins that fixture's group, so every group runs on one
    worker and builds it once, while the other tests spread over both workers one by one."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        shared = sorted(name for name in info.names_closure
                        if any(d.scope == "module" for d in info.name2fixturedefs.get(name, ())))
        if shared:
            item.add_marker(pytest.mark.xdist_group(f"{item.module.__name__}:{'+'.join(shared)}"))
