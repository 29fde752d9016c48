"""The trained tiny model's cache: trained once per content address, copied after that, never half-written."""

from __future__ import annotations

import functools
import json

import pytest

from repack.stand_ins import tiny_model


@pytest.fixture
def stand_in_build(monkeypatch):
    """Stands in for the training (seconds of torch): writes a small folder and counts its calls."""
    calls: list[dict] = []
    real = tiny_model.build_tiny_qat_checkpoint

    @functools.wraps(real)  # same signature: the cache key fills in its defaults
    def build(out_dir, **kwargs):
        calls.append(kwargs)
        if kwargs.get("seed") == 13:
            (tiny_model.Path(out_dir)).mkdir(parents=True)
            raise RuntimeError("killed while training")
        out = tiny_model.Path(out_dir)
        out.mkdir(parents=True)
        (out / "config.json").write_text(json.dumps(kwargs))
        (out / "model.safetensors").write_bytes(b"w" * 100)
        return tiny_model.TinyModelInfo(path=out, accuracy=0.99, grid_tensors=["a"], permutation_seed=0)

    monkeypatch.setattr(tiny_model, "build_tiny_qat_checkpoint", build)
    return calls


def test_second_request_is_copied_from_the_cache(stand_in_build, tmp_path):
    cache = tmp_path / "cache"
    first = tiny_model.cached_tiny_qat_checkpoint(tmp_path / "a", cache_dir=cache)
    second = tiny_model.cached_tiny_qat_checkpoint(tmp_path / "b", cache_dir=cache, seed=0)  # a default, named
    assert len(stand_in_build) == 1
    assert second.path == tmp_path / "b" and second.accuracy == 0.99 and second.grid_tensors == ["a"]
    assert (first.path / "model.safetensors").read_bytes() == (second.path / "model.safetensors").read_bytes()
    # a copy, not the cache's own files: a test that damages its checkpoint leaves the cache intact
    (second.path / "model.safetensors").write_bytes(b"damaged")
    third = tiny_model.cached_tiny_qat_checkpoint(tmp_path / "c", cache_dir=cache)
    assert (third.path / "model.safetensors").read_bytes() == b"w" * 100 and len(stand_in_build) == 1


def test_other_arguments_train_another_model(stand_in_build, tmp_path):
    cache = tmp_path / "cache"
    tiny_model.cached_tiny_qat_checkpoint(tmp_path / "a", cache_dir=cache)
    tiny_model.cached_tiny_qat_checkpoint(tmp_path / "b", cache_dir=cache, on_grid=False)
    tiny_model.cached_tiny_qat_checkpoint(tmp_path / "c", cache_dir=cache, seed=1)
    assert len(stand_in_build) == 3
    assert len(list((cache / "tiny-model").iterdir())) == 3


def test_a_failed_training_leaves_no_entry(stand_in_build, tmp_path):
    cache = tmp_path / "cache"
    with pytest.raises(RuntimeError, match="killed"):
        tiny_model.cached_tiny_qat_checkpoint(tmp_path / "a", cache_dir=cache, seed=13)
    assert list((cache / "tiny-model").iterdir()) == []


def test_no_cache_trains_every_time(stand_in_build, tmp_path, monkeypatch):
    tiny_model.cached_tiny_qat_checkpoint(tmp_path / "a", cache_dir=None)
    monkeypatch.setenv(tiny_model.CACHE_ENV, "")
    assert tiny_model.default_cache_dir() is None
    tiny_model.cached_tiny_qat_checkpoint(tmp_path / "b")
    assert len(stand_in_build) == 2
    monkeypatch.setenv(tiny_model.CACHE_ENV, str(tmp_path / "elsewhere"))
    assert tiny_model.default_cache_dir() == tmp_path / "elsewhere"


def test_the_key_follows_the_module_source_and_library_versions(monkeypatch, tmp_path):
    key = tiny_model.cache_key()
    assert key == tiny_model.cache_key(seed=0, train_steps=200) != tiny_model.cache_key(train_steps=100)
    edited = tmp_path / "tiny_model.py"
    edited.write_bytes(tiny_model.Path(tiny_model.__file__).read_bytes() + b"\n# changed\n")
    monkeypatch.setattr(tiny_model, "__file__", str(edited))
    assert tiny_model.cache_key() != key


def test_the_key_follows_the_shapes_config(monkeypatch):
    """A stand-in's shape lives in repack/stand_ins/tiny_shapes.py, outside the hashed source: widening the E4B-shaped
    one must not hand out the narrower model cached before."""
    import repack.stand_ins.tiny_shapes as shapes

    key = tiny_model.cache_key(shape="e4b")
    assert key != tiny_model.cache_key(shape="e2b")
    monkeypatch.setitem(shapes.SHAPES, "e4b", {**shapes.SHAPES["e4b"], "hidden_size": 128})
    assert tiny_model.cache_key(shape="e4b") != key
