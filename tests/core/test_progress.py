"""One progress type (tools.core.progress.Progress: done, total, message) for every long operation, a server's
start included (its share done of 1.0); MCP shows a share in percent through one adapter (percent)."""

from __future__ import annotations

import re

from tests.helpers.fixtures import ROOT
from tools.core.progress import percent


def test_a_share_reaches_an_mcp_client_in_percent_to_a_tenth():
    sent: list[tuple[float, float | None, str]] = []
    show = percent(lambda done, total, msg: sent.append((done, total, msg)))
    for share in (0.0, 0.1, 0.4, 0.123, 0.29, 0.9999, 1.0):
        show(share, 1.0, "phase")
    assert sent == [(0.0, 100, "phase"), (10.0, 100, "phase"), (40.0, 100, "phase"), (12.3, 100, "phase"),
                    (29.0, 100, "phase"), (100.0, 100, "phase"), (100.0, 100, "phase")]
    show(3, 12, "files")
    assert sent[-1] == (25.0, 100, "files")


def test_no_module_declares_a_progress_type_of_its_own():
    own = re.compile(r"Callable\[\[(float|int), (float|int)[^\]]*, str\], None\]|Callable\[\[float, str\], None\]")
    found = [str(p.relative_to(ROOT)) for pkg in ("tools", "repack", "gemma4_t4_vllm")
             for p in (ROOT / pkg).rglob("*.py") if p.name != "progress.py" and own.search(p.read_text())]
    assert not found, found
