"""The MCP tests' server: every toolset, roots in the test's folder, state beside them."""

from __future__ import annotations

import pytest

from tools.mcp.app import Settings, create_server
from tools.core.paths import Roots


@pytest.fixture()
def roots(tmp_path) -> Roots:
    (tmp_path / "models").mkdir()
    (tmp_path / "evidence").mkdir()
    return Roots.from_env([str(tmp_path / "models")], [str(tmp_path / "evidence")], environ={})


@pytest.fixture()
def mcp(roots, tmp_path):
    return create_server(Settings(roots=roots, config_overrides={"state_dir": str(tmp_path / "run")}),
                         toolsets="all")
