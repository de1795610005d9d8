"""A pytest plugin for tests/test_readme_kill_tests.py: with ``--collect-only``, writes to the file
named by ``TWOPHASE_SKIPMAP`` each collected test's node id and whether its skip marks skip it
under this process's environment (``skipif`` conditions evaluated as pytest evaluates them)."""

from __future__ import annotations

import json
import os
from typing import Any


def pytest_collection_finish(session: Any) -> None:
    path = os.environ.get("TWOPHASE_SKIPMAP")
    if not path:
        return
    from _pytest.skipping import evaluate_skip_marks

    out = {item.nodeid: evaluate_skip_marks(item) is not None for item in session.items}
    with open(path, "w") as f:
        json.dump(out, f)
