import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))


@pytest.fixture
def tiny_model(tmp_path):
    """The project's tiny random Qwen3 (real.tiny), built in the test's own folder."""
    from real.tiny import make_tiny_model

    return make_tiny_model(tmp_path / "tiny")
