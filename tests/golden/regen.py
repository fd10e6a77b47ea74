"""Regenerate the golden simulator summaries. A deliberate act: review the diff before committing.

    python tests/golden/regen.py
"""

import json
import sys
from pathlib import Path

here = Path(__file__).parent
sys.path.insert(0, str(here.parent))

from test_sim import SCENARIOS, golden_summary  # noqa: E402

for name in sorted(SCENARIOS):
    (here / f"{name}.json").write_text(json.dumps(golden_summary(name), indent=1, sort_keys=True) + "\n")
    print("wrote", name)
