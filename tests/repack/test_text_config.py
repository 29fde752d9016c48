"""A config's text part has one home (repack.config.text_of): the build's checks, the family's identification,
the serving start's context limit, the fidelity record and the roofline all read it there."""

from __future__ import annotations

from repack.family.config import text_of
from repack.family.members import MEMBERS, identify_drafter
from tools.serving.preflight.model_files import model_position_limit


def test_the_text_part_is_the_text_config_else_the_config_itself():
    text = {"hidden_size": 8}
    assert text_of({"text_config": text, "hidden_size": 4}) is text
    top = {"hidden_size": 4}
    assert text_of(top) is top
    assert text_of({"text_config": None, "hidden_size": 4})["hidden_size"] == 4  # not an object: not a text part
    assert text_of({"text_config": {}}) == {}


def test_a_reader_of_the_text_config_only_gets_nothing_where_there_is_none():
    assert text_of({"hidden_size": 4}, whole=False) == {}
    assert text_of({"text_config": [1], "hidden_size": 4}, whole=False) == {}
    assert text_of({"text_config": {"vocab_size": 3}}, whole=False) == {"vocab_size": 3}


def test_a_drafter_without_a_text_config_is_not_read_from_its_top_level():
    """A drafter's vocabulary and heads are its text_config's: the same figures at the top level are not its."""
    e2b = MEMBERS["E2B"]
    cfg = {"model_type": "gemma4_assistant", "backbone_hidden_size": e2b.hidden_size, "vocab_size": 5}
    assert identify_drafter(cfg) is e2b


def test_the_context_limit_is_the_text_parts_then_the_configs(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096, "text_config": '
                                          '{"max_position_embeddings": 2048}}')
    assert model_position_limit(str(tmp_path)) == 2048
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 4096, "text_config": {}}')
    assert model_position_limit(str(tmp_path)) == 4096
