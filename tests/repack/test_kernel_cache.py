"""`python -m repack.kernel_cache` (./setup.sh runs it): the grid kernel is compiled into numba's cache."""

from __future__ import annotations

from repack import kernel_cache


def test_warm_loads_the_numba_kernel_and_says_so(capsys):
    assert kernel_cache.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("repack grid kernel: compiled or loaded from numba's cache in ")


def test_without_numba_it_says_builds_fall_back(monkeypatch, capsys):
    from repack import grid

    monkeypatch.setattr(grid, "_kernel", None)
    monkeypatch.setenv("REPACK_NO_NUMBA", "1")
    assert kernel_cache.main() == 1
    assert "numba is not importable" in capsys.readouterr().out
