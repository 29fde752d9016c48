"""The start result, server_status and a run's provenance read a recorded server's start fields one way: eager and
the embedding method are known after the start, not only in the start's own result."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import psutil

from tests.helpers.fixtures import launched
from tools.measure.provenance import collect
from tools.serving.records.state import ServerState, write_state
from tools.serving.server.server import server_status, stop_server


def _int4_embedding_checkpoint(folder):
    folder.mkdir()
    groups = {"group_0": {"targets": ["Linear"]}, "group_1": {"targets": ["Embedding"]}}
    (folder / "config.json").write_text(json.dumps({"quantization_config": {"config_groups": groups}}))
    return folder


def test_status_and_provenance_report_eager_and_the_embedding_method(serve_config_factory, tmp_path):
    model = _int4_embedding_checkpoint(tmp_path / "emb4")
    cfg = serve_config_factory(model, "fields")
    cfg.log_file.parent.mkdir(parents=True, exist_ok=True)
    cfg.log_file.write_text("INFO 12-01 10:00:00 [api_server.py:1] Application startup complete.\n")
    # a process of its own session stands in for the server (it answers nothing: alive, not healthy)
    proc, token = launched([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        write_state(cfg, ServerState(pid=proc.pid, pgid=proc.pid, create_time=psutil.Process(proc.pid).create_time(),
                                      launch=token,
                                      host=cfg.host, port=cfg.port, base_url=cfg.base_url, model=str(model),
                                      served_name="fields", argv=["vllm", "--model", str(model), "--enforce-eager"],
                                      platform="cpu", started_at="2026-01-01T00:00:00+00:00",
                                      started_ts=time.time(), log_path=str(cfg.log_file)))
        st = server_status(cfg)
        assert st.alive and st.start_fields.eager is True
        assert st.start_fields.embedding_method == "CompressedTensorsEmbeddingWNA16Int"
        prov = collect(cfg.base_url, serve_config=cfg)
        assert prov.server_start_fields["eager"] is True
        assert prov.server_start_fields["embedding_method"] == "CompressedTensorsEmbeddingWNA16Int"
    finally:
        stop_server(cfg, grace_s=5)
        proc.wait(10)
