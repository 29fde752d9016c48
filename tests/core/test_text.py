"""Sizes in messages: a tiny checkpoint's 3 MB read "0.00 GiB" in preflight's source and disk checks."""

from __future__ import annotations

from tools.core.text import size_text


def test_a_size_below_a_gib_keeps_its_figure():
    assert size_text(3 * 2**20 + 2**19) == "3.5 MiB"
    assert size_text(900 * 2**10) == "900 KiB"
    assert size_text(0) == "0 KiB"
    assert size_text(2.64 * 2**30) == "2.64 GiB"
    assert size_text(2**30) == "1.00 GiB"
