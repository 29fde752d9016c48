"""The fit planner (repack/build/fit.py, `python -m repack plan`, the MCP tool plan_fit): the article's E2B columns
within the error it states, the 31B refused plainly, a member planned by name with nothing downloaded."""

from __future__ import annotations

import json

import pytest

from repack.build.fit import ARTICLE_E2B, KV_ERROR, LOAD_ERROR_GIB, PlanParams, kv_layout, plan_fit, plan_member
from repack.family.members import MEMBERS
from repack.stand_ins.synthetic import write_small_checkpoint
from tests.helpers.fixtures import one_line_error, repack_cli


@pytest.mark.parametrize("build", list(ARTICLE_E2B))
def test_e2b_columns_match_the_article_within_the_stated_error(build):
    load, tokens = ARTICLE_E2B[build]
    b = plan_member(MEMBERS["E2B"]).build(build)
    assert abs(b.load_gib - load) <= LOAD_ERROR_GIB
    assert abs(b.kv_tokens - tokens) <= KV_ERROR * tokens
    assert b.fits


def test_text_only_e2b_builds_are_within_a_tenth_of_a_percent():
    """The two builds the calibration sees (text-only) come out of the arithmetic almost exactly; the stated
    error is the multimodal builds', which keep tower buffers and profile an encoder."""
    plan = plan_member(MEMBERS["E2B"])
    for build in ("repack-bf16-emb", "all-4-bit"):
        assert plan.build(build).kv_tokens == pytest.approx(ARTICLE_E2B[build][1], rel=1e-3)
    four = plan.build("all-4-bit").tables_gib
    assert (four["PLE"], four["embed_tokens"], four["lm_head"]) == (1.230, 0.211, 0.211)  # the article's table
    assert plan.build("all-4-bit").size_gib == pytest.approx(2.64, abs=0.005)


def test_kv_arithmetic_is_vllms_for_gemma_4():
    """E2B: 15 layers own their KV (20 share it), 12 sliding (256-wide, window 512) and 3 full (512-wide); the
    sliding page's block widened to match the full one; one 16,384-token request takes 1,024 full blocks and
    4 x 145 sliding ones: the one block count that makes all four of the article's KV figures come out."""
    lay = kv_layout(MEMBERS["E2B"])
    assert lay["kv_owning_layers"] == 15 and lay["kv_shared_layers"] == 20
    assert lay["kinds"]["sliding_attention"]["block_size"] == 32 and lay["kinds"]["full_attention"]["block_size"] == 16
    assert lay["bytes_per_block"] == 3 * 16 * 512 * 2 * 2 and lay["blocks_per_request"] == 1604


def test_31b_does_not_fit_and_the_e4b_all_4_bit_build_does():
    p31 = plan_member(MEMBERS["31B"])
    assert not any(b.fits for b in p31.builds)
    assert p31.build("all-4-bit").verdict.startswith("does not fit: the weights alone load")
    assert "does not fit" in p31.format_table()
    e4b = plan_member(MEMBERS["E4B"])
    assert e4b.build("all-4-bit").fits and not e4b.build("bf16").fits
    # the E4B-shaped synthetic build measured 4.262 GiB (issue 39's run on main)
    assert e4b.build("all-4-bit").size_gib == pytest.approx(4.262, rel=0.02)
    assert not plan_member(MEMBERS["26B-A4B"]).build("qat-w4a16-ct").published


def test_member_by_name_on_the_command_line_offline(capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from tools.cli import repack_cli as cli

    assert cli.main(["plan", "--member", "e2b", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["member"] == "E2B" and [b["build"] for b in d["builds"]] == list(ARTICLE_E2B)
    assert cli.main(["plan", "--member", "31B"]) == 0
    assert "all-4-bit: does not fit" in capsys.readouterr().out


def test_a_plan_that_succeeds_prints_no_error_line(capsys):
    """The estimate's margin against the article is not an error: a plan that exits 0 prints no line a reader or a
    script takes for one (it started "error: loads within ...")."""
    from tools.cli import repack_cli as cli

    for member in ("E2B", "31B"):
        assert cli.main(["plan", "--member", member]) == 0
        out = capsys.readouterr()
        assert not [ln for ln in (out.out + out.err).splitlines() if ln.lower().startswith("error")], out.out
        assert "\nmargin: " in out.out, out.out


def test_plan_of_a_checkpoint_folder_reads_its_member(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["text_config"] = MEMBERS["12B"].text_config()
    (src / "config.json").write_text(json.dumps(cfg))
    assert plan_fit(PlanParams(path=str(src))).member == "12B"
    rc, err = repack_cli(capsys, "plan", write_small_checkpoint(tmp_path / "tiny"))
    assert rc == 2
    one_line_error(err, "config.json: not a known Gemma 4 layout")


@pytest.mark.parametrize("args, needle", [([], "give a checkpoint folder (path) or --member"),
                                         ([".", "--member", "E4B"], "or --member, not both"),
                                         (["--member", "7B"], "--member '7B' is not a Gemma 4 member"),
                                         (["--member", "E2B", "--gpu-memory-utilization", "1.5"],
                                          "--gpu-memory-utilization")])
def test_bad_plan_input_is_one_line(capsys, args, needle):
    rc, err = repack_cli(capsys, "plan", *args)
    assert rc == 2
    one_line_error(err, needle)


def test_the_readme_and_docs_family_tables_say_what_the_planner_says():
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    readme, doc = (root / "README.md").read_text(), (root / "docs" / "repack.md").read_text()
    for name, m in MEMBERS.items():
        b = plan_member(m).build("all-4-bit")
        row = next(line for line in readme.splitlines() if line.startswith(f"| {name} "))
        assert f"{b.size_gib:.2f} GiB" in row and (f"{b.kv_tokens:,} tokens" in row if b.fits else "does not fit" in row)
        drow = next(line for line in doc.splitlines() if line.startswith(f"| {name} "))
        assert f"{b.size_gib:.2f} GiB" in drow and f"{b.load_gib:.2f} GiB" in drow


def test_each_builds_description_is_the_members_own():
    """No placeholder and no table the member lacks in the builds' descriptions: the 12B and the 31B have no
    per-layer embeddings, the 26B-A4B packs experts."""
    for name, m in MEMBERS.items():
        for b in plan_member(m).builds:
            assert "<M>" not in b.what and (name in b.what if b.build == "bf16" else True), b.what
            if b.build == "all-4-bit":
                assert ("PLE" in b.what) == bool(m.hidden_size_per_layer_input), (name, b.what)
                assert ("experts" in b.what) == m.moe, (name, b.what)


def test_the_stated_error_is_e2bs_alone_and_other_members_say_theirs_is_unknown():
    """plan_fit gave E2B's error bars ("loads within 0.08 GiB, KV tokens within 6% against the article's E2B
    figures") for E4B and the 12B, which no measurement backs: only E2B's plan is validated."""
    from repack.build.fit import plan_member
    from repack.family.members import by_name

    e2b = plan_member(by_name("E2B"))
    assert e2b.error["validated"] and e2b.error["load_gib"] == 0.08 and e2b.error["kv_relative"] == 0.06
    assert "margin: validated against the article's E2B figures" in e2b.format_table()
    for name in ("E4B", "12B"):
        plan = plan_member(by_name(name))
        assert plan.error["validated"] is False and plan.error["load_gib"] is None, name
        assert f"margin: unknown, not validated: no measurement of {name} exists" in plan.format_table()


def test_why_the_12bs_kv_tokens_fall_with_a_shorter_context_is_said():
    """The 12B's KV tokens fell from 49,477 at 16,384 context to 26,566 at 8,192 while its users held at about 3,
    unexplained: a request reserves its sliding layers' window plus a prefill chunk whatever the context (86% and
    93% of its blocks), and vLLM counts tokens as requests x context; E2B at the article's 16,384 (36% sliding)
    needs no such note."""
    from repack.build.fit import plan_member
    from repack.family.members import by_name

    long, short = (plan_member(by_name("12B"), max_model_len=n) for n in (16_384, 8_192))
    a, b = long.build("all-4-bit"), short.build("all-4-bit")
    assert (a.kv_tokens, b.kv_tokens) == (49_477, 26_566) and abs(a.max_concurrency - b.max_concurrency) < 0.3
    note = next(n for n in short.notes if n.startswith("KV cache tokens are"))
    assert "1,605 blocks for sliding-window layers" in note and "at 93% sliding" in note
    assert "128 for full-attention ones" in note and "the KV tokens fall with it" in note
    assert not any(n.startswith("KV cache tokens are") for n in plan_member(by_name("E2B")).notes)
