"""Damaged input a careless or hostile user gives: a file where a folder is wanted, JSON of the wrong shape, a
value out of range. Every command answers each with one line naming the file or the option and what to do, exit
2 (a request that timed out: 1, naming the timeout), no traceback, nothing written. None needs a server: the
input is checked first (the request timeout against a small stand-in server)."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from tools.cli import main


def _run(capsys, argv: list[str]) -> tuple[int, str]:
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    return rc, capsys.readouterr().err


def one_line(err: str, command: str, *needles: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith(f"vllm-t4 {command}: "), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.is_dir() else []


# --------------------------------------------------------------------------------------------------------------
# decode


GEN_CONFIGS = {"folder": None, "list": [1], "hot": {"temperature": "hot"}, "top_k-1.5": {"top_k": 1.5},
               "top_p-2": {"top_p": 2.0}, "not-json": "{temperature:"}


@pytest.mark.parametrize("case", list(GEN_CONFIGS))
def test_decode_refuses_a_damaged_generation_config(case, tmp_path, capsys):
    gen = tmp_path / "generation_config.json"
    if case == "folder":
        gen.mkdir()
    else:
        v = GEN_CONFIGS[case]
        gen.write_text(v if isinstance(v, str) else json.dumps(v))
    out = tmp_path / "ev"
    rc, err = _run(capsys, ["decode", "--sampling", "checkpoint", "--generation-config", gen, "--out", out,
                            "--base-url", "http://127.0.0.1:9"])
    assert rc == 2, err
    line = one_line(err, "decode", str(gen))
    if case.startswith("top"):
        assert case.split("-")[0] in line  # the field by name: 1.5 is never sent as 1
    assert not out.exists()


@pytest.mark.parametrize("value", ["-1", "0", "nan"])
def test_decode_refuses_a_request_timeout_that_is_not_positive(value, tmp_path, capsys):
    rc, err = _run(capsys, ["decode", f"--request-timeout-s={value}", "--out", tmp_path / "ev",
                            "--base-url", "http://127.0.0.1:9"])
    assert rc == 2, err
    one_line(err, "decode", "--request-timeout-s")


class _SlowServer(BaseHTTPRequestHandler):
    """Lists a model, answers every GET, and answers a chat request only after a second."""

    def do_GET(self):  # noqa: N802
        body = json.dumps({"data": [{"id": "m", "root": "/nowhere", "max_model_len": 64}]}).encode() \
            if self.path == "/v1/models" else b""
        self.send_response(200 if self.path in ("/v1/models", "/metrics") else 404)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_POST(self):  # noqa: N802
        time.sleep(1.0)
        self.send_response(200)
        self.end_headers()

    def log_message(self, *a):
        pass


@pytest.fixture
def slow_server():
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _SlowServer)
    srv.daemon_threads = True
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_a_request_that_times_out_is_one_line_naming_the_timeout(slow_server, tmp_path, capsys):
    out = tmp_path / "ev"
    out.mkdir()
    rc, err = _run(capsys, ["decode", "--request-timeout-s", "0.05", "--prompts", "1", "--out", out,
                            "--base-url", slow_server])
    assert rc == 1, err
    one_line(err, "decode", "--request-timeout-s", slow_server)
    assert _listing(out) == []


# --------------------------------------------------------------------------------------------------------------
# decode-sweep's drafter, doctor's SPECULATIVE_CONFIG and env file


def _models(tmp_path: Path) -> tuple[Path, Path]:
    root = tmp_path / "models"
    target = root / "target"
    target.mkdir(parents=True)
    (target / "config.json").write_text(json.dumps({"text_config": {"vocab_size": 512, "hidden_size": 128}}))
    return root, target


@pytest.mark.parametrize("case", ["a-file", "config-a-list", "text-config-a-list", "vocab-a-string"])
def test_decode_sweep_refuses_a_damaged_drafter(case, tmp_path, capsys, monkeypatch):
    root, target = _models(tmp_path)
    drafter = root / "drafter"
    if case == "a-file":
        drafter.write_text("not a folder\n")
    else:
        drafter.mkdir()
        cfg = {"config-a-list": [1], "text-config-a-list": {"text_config": [1]},
               "vocab-a-string": {"text_config": {"vocab_size": "512"}}}[case]
        (drafter / "config.json").write_text(json.dumps(cfg))
    state, out = tmp_path / "state", tmp_path / "ev"
    for k, v in {"GEMMA4_T4_MODELS_ROOTS": str(root), "MODEL_NAME": str(target), "STATE_DIR": str(state)}.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("SPECULATIVE_CONFIG", raising=False)
    monkeypatch.chdir(tmp_path)
    rc, err = _run(capsys, ["decode-sweep", "--draft-tokens", "0,2", "--drafter", drafter, "--out", out])
    assert rc == 2, err
    one_line(err, "decode-sweep", str(drafter))
    assert not state.exists() and not out.exists()


def _doctor(capsys, env_file: Path) -> dict:
    capsys.readouterr()
    main(["doctor", "--env-file", str(env_file), "--json"])
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err
    return json.loads(captured.out)


def _check(report: dict, name: str) -> dict:
    return next(c for c in report["checks"] if c["name"] == name)


@pytest.mark.parametrize("case", ["a-file", "config-a-list"])
def test_doctor_reports_a_damaged_drafter_as_its_check(case, tmp_path, capsys, monkeypatch):
    root, target = _models(tmp_path)
    drafter = root / "drafter"
    if case == "a-file":
        drafter.write_text("x\n")
    else:
        drafter.mkdir()
        (drafter / "config.json").write_text("[1]")
    env = tmp_path / "tpu.env"
    env.write_text(f"MODEL_NAME={target}\nSPECULATIVE_CONFIG='{json.dumps({'model': str(drafter)})}'\n")
    monkeypatch.delenv("SPECULATIVE_CONFIG", raising=False)
    check = _check(_doctor(capsys, env), "drafter")
    assert check["status"] == "fail" and str(drafter) in check["value"] and "\n" not in check["value"]


@pytest.mark.parametrize("case", ["invalid-utf8", "start-timeout-negative", "start-timeout-inf"])
def test_doctor_names_the_env_file_and_the_key(case, tmp_path, capsys, monkeypatch):
    _, target = _models(tmp_path)
    env = tmp_path / "tpu.env"
    body = {"invalid-utf8": b"# caf\xe9\n", "start-timeout-negative": b"START_TIMEOUT_S=-1\n",
            "start-timeout-inf": b"START_TIMEOUT_S=inf\n"}[case]
    env.write_bytes(f"MODEL_NAME={target}\n".encode() + body)
    monkeypatch.delenv("START_TIMEOUT_S", raising=False)
    check = _check(_doctor(capsys, env), "config")
    assert check["status"] == "fail" and str(env) in check["value"], check
    assert ("UTF-8" if case == "invalid-utf8" else "START_TIMEOUT_S") in check["value"]
