"""A max_model_len below what the build's own chat template renders for one word cannot serve a chat: the start
checks refuse it before anything launches (exit 2, naming max_model_len), instead of a server that loads for a
minute and then refuses every request. The template and tokenizer are read as vLLM reads them (chat_template.jinja
or tokenizer_config.json; tokenizer.json)."""

from __future__ import annotations

import json
import time

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers

from tools.serving.preflight.model_files import chat_prompt_tokens
from tools.serving.preflight.build_checks import check_max_model_len

TEMPLATE = ("{{ bos_token }} {% for m in messages %}<turn> {{ m['role'] }} {{ m['content'] | trim }} </turn> "
            "{% endfor %}{% if add_generation_prompt %}<turn> model {% endif %}")
# <bos> <turn> user hi </turn> <turn> model: 7 tokens, one a word
WORDS = ["[UNK]", "<bos>", "<turn>", "</turn>", "user", "hi", "model"]


def _build(folder, *, template_in_config: bool = False, template: str = TEMPLATE, processor_file: bool = False):
    folder.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "</turn>"}
    if processor_file:  # the processor's chat_template.json, as multimodal checkpoints ship it
        (folder / "chat_template.json").write_text(json.dumps({"chat_template": template}))
    elif template_in_config:
        config["chat_template"] = [{"name": "tool_use", "template": "x"}, {"name": "default", "template": template}]
    else:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"max_position_embeddings": 4096}))
    return str(folder)


def test_the_chat_template_is_rendered_and_counted_as_the_server_would(tmp_path):
    assert chat_prompt_tokens(_build(tmp_path / "file")) == 7
    assert chat_prompt_tokens(_build(tmp_path / "config", template_in_config=True)) == 7
    # what cannot be read here is left to vLLM, never a refusal
    assert chat_prompt_tokens(_build(tmp_path / "broken", template="{% if %}")) is None
    assert chat_prompt_tokens(_build(tmp_path / "raises", template="{{ raise_exception('no') }}")) is None
    assert chat_prompt_tokens(str(tmp_path / "nothing")) is None


def test_the_template_the_check_counts_is_the_one_readiness_sends_a_chat_for(tmp_path):
    """One reader of a build's chat template: the start check and the readiness chat agree on every layout,
    chat_template.json included (the check used to find no template there and skip)."""
    from tools.serving.server.readiness import has_chat_template

    processor = _build(tmp_path / "processor", processor_file=True)
    assert chat_prompt_tokens(processor) == 7 and has_chat_template(processor)
    bare = _build(tmp_path / "bare", template="")
    (tmp_path / "bare" / "chat_template.jinja").unlink()
    assert chat_prompt_tokens(bare) is None and not has_chat_template(bare)
    for name in ("file", "config"):
        folder = _build(tmp_path / name, template_in_config=name == "config")
        assert has_chat_template(folder) and chat_prompt_tokens(folder) == 7


@pytest.mark.parametrize("max_model_len,status", [(7, "fail"), (8, "ok"), (512, "ok")])
def test_the_start_check_refuses_a_length_the_template_alone_fills(tmp_path, serve_config_factory, max_model_len,
                                                                   status):
    from tools.serving.preflight.checks import Context

    cfg = serve_config_factory(_build(tmp_path / "m"), "m", max_model_len=max_model_len)
    c = check_max_model_len(Context(cfg, None, None, None, None))
    assert c.status == status, c
    if status == "fail":
        assert "chat template renders 7 tokens for a one-word message" in c.value and "than 7" in c.fix
        assert c.detail["parameter"] == "max_model_len"


def test_a_start_below_the_template_is_refused_in_seconds_with_nothing_launched(tmp_path, capsys, monkeypatch):
    """Through the command line: exit 2, one line naming --max-model-len and the template's length, before a port
    is bound or a state file written (vLLM is never started: no stand-in is needed)."""
    from tools.cli import main

    long = "{{ bos_token }}" + " <turn>" * 20 + " " + TEMPLATE  # 28 tokens for one word
    model = _build(tmp_path / "m", template=long)
    monkeypatch.setenv("STATE_DIR", str(tmp_path / "run"))
    t0 = time.monotonic()
    rc = main(["start", "--model", model, "--max-model-len", "16"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[-1].startswith("vllm-t4 start: ") and "--max-model-len 16 cannot hold a chat request" in \
        err[-1] and "renders 28 tokens" in err[-1] and "pass a larger --max-model-len than 28" in err[-1], err
    assert time.monotonic() - t0 < 60 and not list((tmp_path / "run").rglob("vllm*"))
