"""./vllm-t4 fetch against a stand-in hub on loopback (HF_ENDPOINT), then from the cache it filled (HF_HUB_OFFLINE=1).

The stand-in implements only what huggingface_hub 2.4 calls for model_info / snapshot_download / hf_hub_download:
GET /api/models/{repo}/revision/{rev}, GET /api/models/{repo}/tree/{rev}, HEAD and GET (with Range)
/{repo}/resolve/{rev}/{file}; it serves the tiny model's files.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
from pathlib import Path

import pytest

from tools.core.errors import ToolFailure
from tools.serving.hub.fetch import MANIFEST, FetchParams, fetch_checkpoint
from tools.core.errors import BadInput

from tests.helpers.stand_ins.hub import COMMIT, REPO, StandInHub  # noqa: F401

ROOT = Path(__file__).resolve().parents[3]
@pytest.fixture(scope="module")
def hub_files(tmp_path_factory) -> dict[str, bytes]:
    from repack.stand_ins.tiny_model import cached_tiny_qat_checkpoint

    # The tiny model's files as the hub would hold them; what the weights predict does not matter here.
    tiny = cached_tiny_qat_checkpoint(tmp_path_factory.mktemp("hub") / "gemma-4-tiny-qat", train_steps=1).path
    files = {p.name: p.read_bytes() for p in sorted(tiny.iterdir()) if p.is_file()}
    files["README.md"] = b"# not a build file\n"  # left on the hub: a build does not read it
    return files


@pytest.fixture
def hub_env(tmp_path, monkeypatch):
    cache = tmp_path / "hf-cache"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))  # no token file
    monkeypatch.setenv("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    return cache


def _cli(args, env, timeout=300):
    return subprocess.run([str(ROOT / "vllm-t4"), *args], env=env, capture_output=True, text=True, timeout=timeout)


def test_fetch_from_the_stand_in_hub_then_offline_from_its_cache(hub_files, hub_env, tmp_path, monkeypatch):
    models = tmp_path / "models"
    seen: list[tuple[int, int]] = []
    with StandInHub(hub_files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        r = fetch_checkpoint(FetchParams(repo_id=REPO, roots=[str(models)]),
                             progress=lambda done, total, msg: seen.append((done, total, msg)))
        assert any(q.startswith("GET /api/models/") for q in hub.requests)
    out = models / "gemma-4-tiny-qat"
    assert r.out == str(out) and r.commit == COMMIT and not r.offline and not r.already_present
    names = {f.path for f in r.files}
    assert "README.md" not in names and "config.json" in names and "tokenizer.json" in names
    assert "chat_template.jinja" in names and any(n.endswith(".safetensors.index.json") for n in names)
    for f in r.files:
        assert (out / f.path).read_bytes() == hub_files[f.path]
        assert f.sha256 == hashlib.sha256(hub_files[f.path]).hexdigest() and f.size == len(hub_files[f.path])
    manifest = json.loads((out / MANIFEST).read_text())
    assert manifest["commit"] == COMMIT and {f["path"] for f in manifest["files"]} == names
    total = sum(len(hub_files[n]) for n in names)
    downloading = [d for d, _, m in seen if m == "downloading"]
    assert downloading and downloading[-1] == total and all(t == total for _, t, _ in seen)  # progress in bytes
    assert downloading == sorted(downloading) and max(d for d, _, _ in seen) <= total
    # Only the output in the models root: no partial or temporary folder beside it.
    assert [p.name for p in models.iterdir()] == ["gemma-4-tiny-qat"]
    assert (hub_env / "models--acme--gemma-4-tiny-qat" / "refs" / "main").read_text() == COMMIT

    # A second fetch finds the same commit in place: nothing rewritten.
    with StandInHub(hub_files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        again = fetch_checkpoint(FetchParams(repo_id=REPO, roots=[str(models)]))
    assert again.already_present and again.commit == COMMIT

    # The hub gone, offline: resolved from the cache the first fetch filled, through the command line.
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_ENDPOINT="http://127.0.0.1:9")
    done = _cli(["fetch", REPO, "--out", str(tmp_path / "offline" / "tiny"), "--json"], env)
    assert done.returncode == 0, done.stderr
    res = json.loads(done.stdout)
    assert res["offline"] is True and res["commit"] == COMMIT
    assert {f["path"] for f in res["files"]} == names
    assert all(f["sha256"] == hashlib.sha256(hub_files[f["path"]]).hexdigest() for f in res["files"])


def test_offline_without_a_cache_says_what_to_do(hub_env, tmp_path):
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    done = _cli(["fetch", REPO, "--out", str(tmp_path / "m" / "x")], env)
    assert done.returncode == 1 and "HF_HUB_OFFLINE" in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "m").exists()


def test_no_network_is_one_line(hub_env, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    with pytest.raises(ToolFailure, match="no network") as exc:
        fetch_checkpoint(FetchParams(repo_id=REPO, out=str(tmp_path / "m" / "x")))
    assert "\n" not in str(exc.value) and exc.value.detail["kind"] == "network"
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("mode", ["gated401", "gated403"])
def test_gated_repo_names_the_page_and_hf_token(hub_files, hub_env, tmp_path, monkeypatch, mode):
    with StandInHub(hub_files) as hub:
        hub.mode = mode
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ToolFailure) as exc:
            fetch_checkpoint(FetchParams(repo_id=REPO, out=str(tmp_path / "m" / "x")))
    msg = str(exc.value)
    assert f"https://huggingface.co/{REPO}" in msg and "HF_TOKEN" in msg and "gated" in msg and "\n" not in msg
    assert exc.value.detail["status"] == int(mode[-3:])
    assert not (tmp_path / "m").exists() and not list(hub_env.glob("**/blobs/*"))


def test_unknown_repo_and_revision(hub_files, hub_env, tmp_path, monkeypatch):
    with StandInHub(hub_files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ToolFailure, match="not found") as exc:
            fetch_checkpoint(FetchParams(repo_id="acme/nope", out=str(tmp_path / "m" / "x")))
        assert exc.value.detail["kind"] == "repo"
        with pytest.raises(ToolFailure, match="revision 'v9' not found") as exc:
            fetch_checkpoint(FetchParams(repo_id=REPO, revision="v9", out=str(tmp_path / "m" / "x")))
        assert exc.value.detail["kind"] == "revision"
    assert not (tmp_path / "m").exists()


def test_not_enough_disk_is_refused_before_downloading(hub_files, hub_env, tmp_path, monkeypatch):
    from repack.source import checks as disk

    monkeypatch.setattr(disk, "free_bytes", lambda p: (p, 1000))
    with StandInHub(hub_files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ToolFailure, match="not enough disk") as exc:
            fetch_checkpoint(FetchParams(repo_id=REPO, out=str(tmp_path / "m" / "x")))
        assert not any("/resolve/" in q for q in hub.requests)  # nothing downloaded
    assert exc.value.detail["needed_bytes"] > exc.value.detail["free_bytes"] == 1000


@pytest.mark.parametrize("repo", ["../etc", "/acme/x", "acme/x/y", "acme/..", "acme", "ac me/x"])
def test_repo_ids_with_path_tricks_are_refused(repo, tmp_path):
    with pytest.raises(BadInput, match="not owner/name"):
        fetch_checkpoint(FetchParams(repo_id=repo, out=str(tmp_path / "x")))
    assert not (tmp_path / "x").exists()


def test_an_empty_repo_id_is_refused_by_the_parameters(tmp_path):
    """The bounded-string rule of every parameter model (tools.core.params) refuses it before any fetch."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="must not be empty"):
        FetchParams(repo_id="", out=str(tmp_path / "x"))
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("rev", ["a..b", "../main", "main/", "-rf", "x y", "heads@{1}", "v1.lock"])
def test_revisions_that_are_not_a_branch_tag_or_commit_are_refused(rev, tmp_path):
    with pytest.raises(BadInput, match="not a branch, tag or 40-hex commit"):
        fetch_checkpoint(FetchParams(repo_id=REPO, revision=rev, out=str(tmp_path / "x")))


def test_output_outside_the_roots_is_refused(tmp_path):
    roots = [str(tmp_path / "models")]
    for out in (str(tmp_path / "elsewhere" / "x"), "../escape", "/etc/x"):
        with pytest.raises(BadInput, match="outside the models roots"):
            fetch_checkpoint(FetchParams(repo_id=REPO, out=out, roots=roots))
    assert not (tmp_path / "elsewhere").exists()


def test_command_line_bad_input_exits_2_with_one_line(tmp_path):
    done = _cli(["fetch", "acme/../x", "--out", str(tmp_path / "x")], dict(os.environ))
    assert done.returncode == 2 and done.stderr.count("\n") == 1 and "owner/name" in done.stderr
    done = _cli(["fetch", REPO, "--revision", "a..b", "--out", str(tmp_path / "x")], dict(os.environ))
    assert done.returncode == 2 and "revision" in done.stderr


def test_an_interrupted_fetch_resumes_through_the_cache(hub_files, hub_env, tmp_path, monkeypatch):
    """huggingface_hub 2.4 resumes a dropped connection inside one fetch (a ranged GET from the bytes it has) and,
    across fetches, keeps every file it completed; a file cut off for good is fetched whole next time."""
    import types

    from huggingface_hub import constants, file_download

    # huggingface_hub waits 1 s before each of its 5 retries of a dropped download: the retries are what this test
    # is about, not the waiting.
    backoff: list[float] = []
    monkeypatch.setattr(file_download, "time", types.SimpleNamespace(sleep=backoff.append))
    models = tmp_path / "models"
    # A file over two of huggingface_hub's download chunks: it keeps the chunks it received whole.
    chunk = constants.DOWNLOAD_CHUNK_SIZE
    big = "model-extra.safetensors"
    hub_files = dict(hub_files, **{big: os.urandom(2 * chunk + 4096)})
    with StandInHub(hub_files) as hub:
        hub.cut = big  # every attempt at this file stops at half: the fetch fails
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ToolFailure, match="resumes") as exc:
            fetch_checkpoint(FetchParams(repo_id=REPO, roots=[str(models)]))
        assert exc.value.detail["kind"] == "dropped" and "\n" not in str(exc.value)
        assert (big, chunk) in hub.ranges  # the retry asked for what it lacked, from its first whole chunk on
        assert backoff and set(backoff) == {1}
    assert not models.exists() or list(models.iterdir()) == []  # nothing half-done in the models root
    blobs = {p.name for p in hub_env.glob("models--acme--gemma-4-tiny-qat/blobs/*")}
    done_before = {n for n in hub_files if hashlib.sha256(hub_files[n]).hexdigest() in blobs}
    assert big not in done_before and len(done_before) >= 2
    with StandInHub(hub_files) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        r = fetch_checkpoint(FetchParams(repo_id=REPO, roots=[str(models)]))
        fetched = {q.rsplit("/", 1)[1] for q in hub.requests if q.startswith("GET /acme/")}
    assert big in fetched and not fetched & done_before  # completed files came from the cache
    assert all((Path(r.out) / f.path).read_bytes() == hub_files[f.path] for f in r.files)


@pytest.mark.parametrize("member", ["E2B", "e4b", "12B", "26B-A4B", "31B"])
def test_a_member_name_fetches_googles_qat_checkpoint_of_it(member, hub_env, tmp_path, monkeypatch):
    from repack.family.members import by_name
    from tools.serving.hub.fetch import check_repo_id

    repo = f"google/gemma-4-{by_name(member).name}-it-qat-q4_0-unquantized"
    assert check_repo_id(member) == repo
    with StandInHub({}) as hub:  # it serves another repo: the request shows which one the fetch asked for
        monkeypatch.setenv("HF_ENDPOINT", hub.url)
        with pytest.raises(ToolFailure):
            fetch_checkpoint(FetchParams(repo_id=member, roots=[str(tmp_path / "models")]))
    assert any(q.startswith(f"GET /api/models/{repo}/") for q in hub.requests), hub.requests
    assert not (tmp_path / "models" / repo.split("/")[1]).exists()
