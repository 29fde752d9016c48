"""Source files checked as the formats define them before a build or a probe reads them: safetensors layout
(with the safetensors library itself as the oracle), config.json types and nesting, renames that would collide,
links that lead out of the checkpoint folder or the roots, and the output's own layout (aligned like the
safetensors writer's)."""

from __future__ import annotations

import json
import os
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
import safetensors
from safetensors import safe_open

from repack.build.build import BuildOptions, build_checkpoint
from repack.source.checkpoint import open_checkpoint
from repack.errors import RepackError
from repack.build.probe import probe_checkpoint
from repack.source.safetensors_io import DTYPES, MappedFile
from repack.stand_ins.synthetic import grid_words, write_small_checkpoint

from tests.helpers.fixtures import one_line_error, repack_cli

FULL = ["--text-only", "--embed-int4", "--embed-tokens"]
UP0 = "model.language_model.layers.0.mlp.up_proj.weight"




def _refused(src: Path, tmp_path: Path, capsys, *needles: str) -> str:
    """The build and the probe both refuse SRC with one line and status 2, and write nothing."""
    out = tmp_path / "out"
    rc, err = repack_cli(capsys, "build", str(src), str(out), *FULL)
    assert rc == 2, err
    line = one_line_error(err, *needles)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    rc, err = repack_cli(capsys, "probe", str(src))
    assert rc == 2, err
    one_line_error(err, *needles)
    return line


def _write_raw(path: Path, header: dict | None, data: bytes, raw_header: bytes | None = None) -> None:
    raw = raw_header if raw_header is not None else json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def _library_refuses(path: Path) -> bool:
    """The safetensors library's verdict: it validates the whole layout on open (numpy has no bf16 to read)."""
    try:
        with safe_open(str(path), "np") as f:
            for k in f.keys():
                if f.get_slice(k).get_dtype() != "BF16":
                    f.get_tensor(k)
    except safetensors.SafetensorError:
        return True
    return False


def _e(dtype: str, shape: list, begin, end) -> dict:
    return {"dtype": dtype, "shape": shape, "data_offsets": [begin, end]}


# Corrupt layouts: (header entries, data length, the tensor the error must name, words the error must hold).
CORRUPT = {
    "overlap": ({"a": _e("F32", [2], 0, 8), "b": _e("F16", [2], 6, 10)}, 10, "b", "overlaps tensor a"),
    "same-range": ({"a": _e("F32", [2], 0, 8), "b": _e("F32", [2], 0, 8)}, 8, "b", "overlaps"),
    "empty-inside": ({"a": _e("F32", [2], 0, 8), "z": _e("F32", [0], 4, 4)}, 8, "z", "overlaps"),
    "gap": ({"a": _e("F32", [2], 0, 8), "b": _e("F16", [2], 10, 14)}, 14, "b", "unaccounted"),
    "not-from-zero": ({"a": _e("F32", [2], 4, 12)}, 12, "a", "unaccounted"),
    "trailing-bytes": ({"a": _e("F32", [2], 0, 8), "b": _e("F16", [2], 8, 12)}, 20, "b", "8 trailing bytes"),
    "size-mismatch": ({"a": _e("F32", [3], 0, 8)}, 8, "a", "inconsistent offsets"),
    "float-offset": ({"a": _e("F32", [2], 0.0, 8)}, 8, "a", "corrupt header entry"),
    "bool-shape": ({"a": _e("F32", [True, 2], 0, 8)}, 8, "a", "corrupt header entry"),
    "string-shape": ({"a": _e("F32", ["2"], 0, 8)}, 8, "a", "corrupt header entry"),
    "reversed-offsets": ({"a": _e("F32", [0], 8, 0), "b": _e("F32", [2], 0, 8)}, 8, "a", "inconsistent"),
}


@pytest.mark.parametrize("case", sorted(CORRUPT))
def test_corrupt_layout_refused_like_the_library(tmp_path, capsys, case):
    entries, n, tensor, words = CORRUPT[case]
    src = write_small_checkpoint(tmp_path / "src")
    st = src / "model.safetensors"
    _write_raw(st, {"__metadata__": {"format": "pt"}, **entries}, bytes(range(256))[:n] if n <= 256 else b"\1" * n)
    assert _library_refuses(st)
    line = _refused(src, tmp_path, capsys, "model.safetensors", words)
    assert f"tensor {tensor} " in line, line


def test_trailing_bytes_with_no_tensor_refused(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    st = src / "model.safetensors"
    _write_raw(st, {"__metadata__": {"format": "pt"}}, b"\0" * 16)
    assert _library_refuses(st)
    _refused(src, tmp_path, capsys, "model.safetensors", "16 trailing bytes")


def test_metadata_must_map_to_strings(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    st = src / "model.safetensors"
    _write_raw(st, {"__metadata__": {"format": 1}, "a": _e("F32", [2], 0, 8)}, b"\0" * 8)
    assert _library_refuses(st)
    _refused(src, tmp_path, capsys, "model.safetensors", "__metadata__")


def test_real_shard_with_tensors_overlapping_is_refused(tmp_path, capsys):
    """The full small checkpoint, one tensor pointed at its neighbour's bytes (same size): exit 0 before."""
    src = write_small_checkpoint(tmp_path / "src")
    st = src / "model.safetensors"
    raw = st.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    q0, q1 = (f"model.language_model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1))
    header[q1]["data_offsets"] = header[q0]["data_offsets"]  # same shape, so the size check alone passes
    data = raw[8 + n:]
    _write_raw(st, header, data)
    assert _library_refuses(st)
    _refused(src, tmp_path, capsys, "model.safetensors", "overlaps")


def test_header_order_is_free(tmp_path, capsys):
    """A valid file whose header lists tensors out of offset order: both the library and the build accept it."""
    src = write_small_checkpoint(tmp_path / "src")
    st = src / "model.safetensors"
    raw = st.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    shuffled = dict(reversed(list(header.items())))
    _write_raw(st, shuffled, raw[8 + n:])
    assert not _library_refuses(st)
    rc, err = repack_cli(capsys, "build", str(src), str(tmp_path / "out"), *FULL)
    assert rc == 0, err


def test_hostile_long_name_is_clipped_in_the_message(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    st = src / "model.safetensors"
    name = "x" * 100_000 + "\x1b[31m"
    _write_raw(st, {"a": _e("F32", [2], 0, 8), name: _e("F32", [2], 4, 12)}, b"\0" * 12)
    assert _library_refuses(st)
    line = _refused(src, tmp_path, capsys, "overlaps")
    assert len(line) < 700 and "\x1b" not in line and "[...]" in line


# ---------------------------------------------------------------------------------------------- config.json


def _set_config(src: Path, edit) -> None:
    cfg = json.loads((src / "config.json").read_text())
    edit(cfg)
    (src / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("value", ["missing", None, [], ["x"], "text"])
def test_multimodal_weights_need_a_text_config(tmp_path, capsys, value):
    src = write_small_checkpoint(tmp_path / "src")
    if value == "missing":
        _set_config(src, lambda c: c.pop("text_config"))
    else:
        _set_config(src, lambda c: c.update(text_config=value))
    _refused(src, tmp_path, capsys, "config.json", "text_config")


def test_text_config_without_multimodal_weights_is_refused(tmp_path, capsys):
    """A text-only checkpoint's weights with a multimodal config: nothing would be quantized or renamed."""
    src = write_small_checkpoint(tmp_path / "src")
    out = tmp_path / "text"
    build_checkpoint(src, out, BuildOptions(quantize_linears=False, text_only=True, embed_int4=False,
                                            embed_tokens=False))
    (out / "config.json").write_text((src / "config.json").read_text())
    _refused(out, tmp_path, capsys, "config.json", "text_config", "model.language_model.")


@pytest.mark.parametrize("qc", ["x", 3, ["Linear"], {"config_groups": ["g"]}, {"config_groups": {"g": "Linear"}},
                                {"config_groups": {"g": {"targets": "Linear"}}}])
def test_quantization_config_of_the_wrong_type(tmp_path, capsys, qc):
    src = write_small_checkpoint(tmp_path / "src")
    _set_config(src, lambda c: c.update(quantization_config=qc))
    _refused(src, tmp_path, capsys, "config.json", "quantization_config")
    _set_config(src, lambda c: (c.pop("quantization_config"), c["text_config"].update(quantization_config=qc)))
    _refused(src, tmp_path, capsys, "config.json", "text_config.quantization_config")


@pytest.mark.parametrize("where", ["top", "group"])
@pytest.mark.parametrize("fmt", [["pack-quantized"], {"a": 1}, 4])
def test_quantization_format_of_the_wrong_type(tmp_path, capsys, where, fmt):
    """The format of a kept group names the output's format: it must be a string."""
    src = write_small_checkpoint(tmp_path / "src")
    group = {"targets": ["re:.*embed_tokens_per_layer$"]}
    qc = {"format": fmt, "config_groups": {"g": group}} if where == "top" else \
        {"format": "pack-quantized", "config_groups": {"g": {**group, "format": fmt}}}
    _set_config(src, lambda c: c.update(quantization_config=qc))
    _refused(src, tmp_path, capsys, "config.json", "quantization_config.",
             "format" if where == "top" else "config_groups.g.format", "not a string")


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_config_number_that_is_not_finite_is_refused(tmp_path, capsys, literal):
    """Python reads these; the config written from them would not be JSON."""
    src = write_small_checkpoint(tmp_path / "src")
    text = (src / "config.json").read_text()
    (src / "config.json").write_text(text.replace('"vocab_size": 64', f'"vocab_size": {literal}', 1))
    assert literal in (src / "config.json").read_text()
    _refused(src, tmp_path, capsys, "config.json", "text_config.vocab_size", "finite")


@pytest.mark.parametrize("key, value", [("num_experts", "4"), ("num_experts", [4]), ("num_experts", 4.5),
                                        ("hidden_size", "64"), ("num_hidden_layers", True),
                                        ("enable_moe_block", "yes")])
def test_a_text_shape_of_the_wrong_type_is_refused_before_use(tmp_path, capsys, key, value):
    """Each command reading the text model's shapes (build, probe, plan) refuses a key of the wrong type in one
    line naming it, before comparing or counting with it (a bare TypeError before; a string "4" read as
    "holds 4 experts, but config.json declares num_experts 4")."""
    src = write_small_checkpoint(tmp_path / "src")
    _set_config(src, lambda c: c["text_config"].update({key: value}))
    line = _refused(src, tmp_path, capsys, "config.json", f"text_config.{key}")
    assert ("not a boolean" if key == "enable_moe_block" else "not a whole number") in line
    rc, err = repack_cli(capsys, "plan", str(src))
    assert rc == 2, err
    one_line_error(err, "config.json", f"text_config.{key}")


def test_a_stale_quantization_group_is_not_kept_beside_bf16_weights(tmp_path, capsys):
    """A source config declaring bf16 linears int4: a build that leaves them bf16 declares them bf16."""
    src = write_small_checkpoint(tmp_path / "src")
    _set_config(src, lambda c: c.update(quantization_config={
        "format": "pack-quantized", "config_groups": {"g": {"targets": ["Linear"], "weights": {"num_bits": 4}}}}))
    out = tmp_path / "out"
    rc, err = repack_cli(capsys, "build", str(src), str(out), "--no-quantize-linears", "--embed-int4")
    assert rc == 0, err
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert [g["targets"] for g in qc["config_groups"].values()] == [["re:.*embed_tokens_per_layer$"]]
    rc, err = repack_cli(capsys, "build", str(src), str(tmp_path / "out2"), "--no-quantize-linears")
    assert rc == 0, err
    assert "quantization_config" not in json.loads((tmp_path / "out2" / "config.json").read_text())


@pytest.mark.parametrize("depth", [100, 200_000])
def test_deeply_nested_config(tmp_path, capsys, depth):
    src = write_small_checkpoint(tmp_path / "src")
    cfg = json.loads((src / "config.json").read_text())
    text = json.dumps(cfg)[:-1] + ', "deep": ' + "[" * depth + "]" * depth + "}"
    (src / "config.json").write_text(text)
    _refused(src, tmp_path, capsys, "config.json", "nested")


def test_deeply_nested_index(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    (src / "model.safetensors.index.json").write_text('{"weight_map": ' + "[" * 200_000 + "]" * 200_000 + "}")
    _refused(src, tmp_path, capsys, "model.safetensors.index.json", "nested")


def test_deeply_nested_safetensors_header(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    _write_raw(src / "model.safetensors", None, b"", raw_header=b'{"a":' + b"[" * 200_000 + b"]" * 200_000 + b"}")
    _refused(src, tmp_path, capsys, "model.safetensors", "corrupt safetensors header")


# ---------------------------------------------------------------------------------------------- renames, shapes


def test_two_sources_for_one_output_name(tmp_path, capsys):
    norm = np.ones(64, dtype="<u2").tobytes()
    src = write_small_checkpoint(tmp_path / "src", extra={"model.norm.weight": ("BF16", (64,), norm)})
    out = tmp_path / "out"
    rc, err = repack_cli(capsys, "build", str(src), str(out), *FULL)
    assert rc == 2
    one_line_error(err, "model.language_model.norm.weight", "model.norm.weight", "both")
    assert not out.exists()
    # without the rename there is no collision: the multimodal build keeps both
    rc, err = repack_cli(capsys, "build", str(src), str(out))
    assert rc == 0, err
    assert {"model.norm.weight", "model.language_model.norm.weight"} <= set(open_checkpoint(out).tensors)


def test_linear_with_no_columns(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src", extra={UP0: ("BF16", (128, 0), b"")})
    rc, err = repack_cli(capsys, "build", str(src), str(tmp_path / "out"), *FULL)
    assert rc == 2
    one_line_error(err, UP0, "[128, 0]")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("shape", [(2, 64, 64), (2, 2, 32, 32)])
def test_linear_of_more_than_two_dimensions(tmp_path, capsys, shape):
    """Copied as bf16 it would sit beside a config declaring every Linear int4: refused like a (128, 0) one."""
    src = write_small_checkpoint(tmp_path / "src", extra={UP0: ("BF16", shape, bytes(2 * int(np.prod(shape))))})
    rc, err = repack_cli(capsys, "build", str(src), str(tmp_path / "out"), *FULL)
    assert rc == 2
    one_line_error(err, UP0, str(list(shape)))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- links


def test_symlink_loop_is_named(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    (src / "model.safetensors").unlink()
    os.symlink("b.safetensors", src / "model.safetensors")
    os.symlink("model.safetensors", src / "b.safetensors")
    _refused(src, tmp_path, capsys, "model.safetensors", "symlink loop")
    loop = tmp_path / "loop"
    os.symlink(loop, loop)
    rc, err = repack_cli(capsys, "build", str(loop), str(tmp_path / "out"))
    assert rc == 2
    one_line_error(err, "symlink loop")


def test_symlink_loop_in_an_indexed_shard(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    names = list(json.loads((src / "model.safetensors")
                            .read_bytes()[8:8 + struct.unpack("<Q", (src / "model.safetensors").read_bytes()[:8])[0]]))
    (src / "model.safetensors").rename(src / "model-00001-of-00002.safetensors")
    os.symlink("model-00002-of-00002.safetensors", src / "model-00002-of-00002.safetensors")
    wm = {n: "model-00001-of-00002.safetensors" for n in names if n != "__metadata__"}
    wm["extra"] = "model-00002-of-00002.safetensors"
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    _refused(src, tmp_path, capsys, "model-00002-of-00002.safetensors", "symlink loop")


def _move_out(src: Path, name: str, elsewhere: Path) -> Path:
    elsewhere.mkdir(exist_ok=True)
    target = elsewhere / name
    shutil.move(src / name, target)
    os.symlink(target, src / name)
    return target


@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "tokenizer.json"])
def test_link_out_of_the_checkpoint_folder_is_refused(tmp_path, capsys, name):
    src = write_small_checkpoint(tmp_path / "src")
    _move_out(src, name, tmp_path / "secret-place")
    line = _refused(src, tmp_path, capsys, name, "outside the checkpoint folder") if name != "tokenizer.json" \
        else None
    if line is None:  # side files are opened by the build only (the probe reads weights)
        rc, err = repack_cli(capsys, "build", str(src), str(tmp_path / "out"), *FULL)
        assert rc == 2
        line = one_line_error(err, name, "outside the checkpoint folder")
        assert not (tmp_path / "out").exists()
    assert "secret-place" not in line


def test_index_naming_a_shard_outside_the_folder(tmp_path, capsys):
    src = write_small_checkpoint(tmp_path / "src")
    head = (src / "model.safetensors").read_bytes()
    names = [n for n in json.loads(head[8:8 + struct.unpack("<Q", head[:8])[0]]) if n != "__metadata__"]
    (src / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    (src / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {n: "../elsewhere.safetensors" for n in names}}))
    line = _refused(src, tmp_path, capsys, "outside the checkpoint folder")
    assert str(tmp_path / "elsewhere") not in line


def _hf_cache_snapshot(tmp_path: Path) -> Path:
    """The Hugging Face cache layout: snapshots/REV/<file> links to ../../blobs/<hash>."""
    repo = tmp_path / "hub" / "models--google--tiny"
    snap = write_small_checkpoint(repo / "snapshots" / "abc123")
    (repo / "blobs").mkdir()
    for i, p in enumerate(sorted(snap.iterdir())):
        blob = repo / "blobs" / f"{i:040x}"
        shutil.move(p, blob)
        os.symlink(os.path.relpath(blob, snap), p)
    return snap


def test_hugging_face_cache_snapshot_is_read(tmp_path, capsys):
    snap = _hf_cache_snapshot(tmp_path)
    rc, err = repack_cli(capsys, "build", str(snap), str(tmp_path / "out"), *FULL)
    assert rc == 0, err


def test_roots_confine_the_files_read(tmp_path):
    """With roots (the MCP server's), a file that resolves outside them is refused even when the checkpoint's
    own layout allows it."""
    snap = _hf_cache_snapshot(tmp_path)
    root = snap.parent  # the snapshot folder is inside the root, the blobs it links to are not
    with pytest.raises(RepackError, match="outside the allowed roots") as e:
        probe_checkpoint(snap, roots=[root])
    assert "blobs" not in str(e.value)
    with pytest.raises(RepackError, match="outside the allowed roots"):
        build_checkpoint(snap, root / "out", BuildOptions(), roots=[root])
    assert not (root / "out").exists()
    assert probe_checkpoint(snap, roots=[tmp_path / "hub"]).verdict == "qat"


def test_a_shard_replaced_after_its_header_was_read_is_not_mapped(tmp_path):
    src = write_small_checkpoint(tmp_path / "src")
    ck = open_checkpoint(src)
    info = next(iter(ck.tensors.values()))
    st = src / "model.safetensors"
    data = st.read_bytes()
    st.unlink()
    st.write_bytes(data + b"\0" * 8)
    with pytest.raises(RepackError, match="changed since its header was read"):
        MappedFile(info.file, info.ident)


# ---------------------------------------------------------------------------------------------- output layout


def _header(path: Path) -> tuple[int, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return n, raw[8:8 + n]


@pytest.mark.parametrize("options", [dict(), dict(quantize_linears=True, text_only=False, embed_int4=False,
                                                  embed_tokens=False), dict(embed_tokens=False)])
def test_output_tensors_are_aligned_like_the_safetensors_writer(tmp_path, options):
    src = write_small_checkpoint(tmp_path / "src", extra={
        "model.language_model.odd.weight": ("BF16", (3,), np.arange(3, dtype="<u2").tobytes()),
        "model.language_model.odd_proj.weight": ("BF16", (3, 32), grid_words(3, 32, np.random.default_rng(2))),
        "model.language_model.counter": ("I64", (1,), np.arange(1, dtype="<i8").tobytes())})
    out = tmp_path / "out"
    build_checkpoint(src, out, BuildOptions(**options))
    shards = sorted(out.glob("*.safetensors"))
    assert shards
    for shard in shards:
        n, head = _header(shard)
        assert n % 8 == 0 and head.endswith(b"}" + b" " * (len(head) - len(head.rstrip(b" "))))
        header = json.loads(head)
        header.pop("__metadata__", None)
        for name, e in header.items():
            size = DTYPES[e["dtype"]][1]
            assert (8 + n + e["data_offsets"][0]) % size == 0, (shard.name, name, e)
        # the safetensors library reads every tensor, and writing the same tensors itself gives the same header
        loaded = {}
        with safe_open(str(shard), "np") as f:
            for k in f.keys():
                if header[k]["dtype"] != "BF16":
                    loaded[k] = f.get_tensor(k)
        specs, keep = {}, []
        blob = shard.read_bytes()
        for name, e in header.items():
            b0, b1 = e["data_offsets"]
            buf = np.frombuffer(blob, dtype=np.uint8, count=b1 - b0, offset=8 + n + b0).copy()
            keep.append(buf)
            specs[name] = safetensors.TensorSpec(dtype=_torch_name(e["dtype"]), shape=e["shape"],
                                                 data_ptr=buf.ctypes.data, data_len=buf.nbytes)
        meta = json.loads(head).get("__metadata__")
        assert safetensors.serialize(specs, meta) == blob
        for k, v in loaded.items():
            b0, b1 = header[k]["data_offsets"]
            assert v.tobytes() == blob[8 + n + b0:8 + n + b1]


def _torch_name(st: str) -> str:
    return {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "I8": "int8", "U8": "uint8",
            "I16": "int16", "U16": "uint16", "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
            "BOOL": "bool"}[st]


def test_mcp_tools_pass_their_roots(tmp_path):
    """Through MCP, the source folder is inside the models root but the files it links to are not: refused by
    probe_checkpoint and repack_checkpoint, without saying where the links point."""
    import asyncio

    from fastmcp import Client
    from fastmcp.exceptions import ToolError

    import server as mcp_server
    from tools.core.paths import Roots

    snap = _hf_cache_snapshot(tmp_path)
    (tmp_path / "evidence").mkdir()
    roots = Roots.from_env([str(snap.parent)], [str(tmp_path / "evidence")], environ={})
    mcp = mcp_server.create_server(mcp_server.Settings(roots=roots, config_overrides={
        "state_dir": str(tmp_path / "run")}))

    async def go() -> list[str]:
        errors = []
        async with Client(mcp) as c:
            for tool, args in (("probe_checkpoint", {"path": snap.name}),
                               ("repack_checkpoint", {"source": snap.name, "output": "out"})):
                with pytest.raises(ToolError) as e:
                    await c.call_tool(tool, args)
                errors.append(str(e.value))
        return errors

    for msg in asyncio.run(go()):
        assert "outside the allowed roots" in msg and "blobs" not in msg, msg
    assert not (snap.parent / "out").exists()


@pytest.mark.parametrize("how", ["empty-index", "empty-shard"])
def test_a_checkpoint_with_no_tensors_is_refused(tmp_path, capsys, how):
    """An empty weight_map or a shard without tensors would build an empty output with status 0."""
    src = write_small_checkpoint(tmp_path / "src")
    if how == "empty-index":
        (src / "model.safetensors.index.json").write_text('{"weight_map": {}}')
        _refused(src, tmp_path, capsys, "model.safetensors.index.json", "no tensors")
    else:
        _write_raw(src / "model.safetensors", {"__metadata__": {"format": "pt"}}, b"")
        _refused(src, tmp_path, capsys, "model.safetensors", "no tensors")


def test_index_naming_one_shard_two_ways(tmp_path, capsys):
    """`./model.safetensors` and `model.safetensors` are one file: not a tensor stored twice."""
    src = write_small_checkpoint(tmp_path / "src")
    names = [n for n in open_checkpoint(src).tensors]
    wm = {n: "./model.safetensors" if i % 2 else "model.safetensors" for i, n in enumerate(names)}
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    rc, err = repack_cli(capsys, "build", str(src), str(tmp_path / "out"), *FULL)
    assert rc == 0, err
    assert open_checkpoint(tmp_path / "out").tensors
