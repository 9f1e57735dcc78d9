"""Bad input to the converter: each case is a typed error naming the file and the problem, and writes nothing."""

import json
import shutil
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from convert import convert_checkpoint
from day0jax.core.errors import CheckpointError, ConfigError, UnsupportedArchitecture


@pytest.fixture
def hf(tiny, tmp_path):
    """A writable copy of the tiny llama folder."""
    src = tmp_path / "src"
    shutil.copytree(tiny["llama"]["hf"], src)
    return src


def convert_fails(src, tmp_path, error, match):
    dst = tmp_path / "dst"
    with pytest.raises(error, match=match):
        convert_checkpoint(src, dst, progress=False)
    assert not dst.exists() and not list(tmp_path.glob(".dst.tmp-*"))


def write_safetensors(path, header: dict, data: bytes = b""):
    raw = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + data)


def test_truncated_safetensors(hf, tmp_path):
    f = hf / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    convert_fails(hf, tmp_path, CheckpointError, r"model\.safetensors: tensor '.*' ends at byte \d+, past the end")


def test_header_length_beyond_file(hf, tmp_path):
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", 10 ** 9) + b"{}")
    convert_fails(hf, tmp_path, CheckpointError, r"model\.safetensors: header length 1000000000 runs past the end")


def test_overlapping_offsets(hf, tmp_path):
    write_safetensors(hf / "model.safetensors", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]}}, bytes(24))
    convert_fails(hf, tmp_path, CheckpointError, r"tensors 'a' and 'b' overlap")


def test_offsets_out_of_range_and_size_mismatch(hf, tmp_path):
    write_safetensors(hf / "model.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}},
                      bytes(8))
    convert_fails(hf, tmp_path, CheckpointError, r"tensor 'a' ends at byte \d+, past the end")
    write_safetensors(hf / "model.safetensors", {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 12]}},
                      bytes(16))
    convert_fails(hf, tmp_path, CheckpointError, r"tensor 'a' of shape \(4,\) F32 needs 16 bytes but its offsets "
                                                 r"span 12")


def test_not_safetensors(hf, tmp_path):
    (hf / "model.safetensors").write_text("this is not a safetensors file at all, just some text")
    convert_fails(hf, tmp_path, CheckpointError, r"model\.safetensors: (header .* runs past|header is not JSON)")


def test_pickle_only_folder_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (src / "pytorch_model.bin").write_bytes(b"\x80\x04not really a pickle")
    convert_fails(src, tmp_path, CheckpointError, r"only PyTorch pickle weights .* never unpickled")


def test_missing_and_malformed_config(hf, tmp_path):
    (hf / "config.json").unlink()
    convert_fails(hf, tmp_path, ConfigError, r"config\.json not found")
    (hf / "config.json").write_text("{not json")
    convert_fails(hf, tmp_path, ConfigError, r"config\.json: not valid JSON")
    (hf / "config.json").write_text(json.dumps({"hidden_size": 64}))
    convert_fails(hf, tmp_path, ConfigError, r"no 'model_type'")


def test_index_naming_a_missing_shard(hf, tmp_path):
    (hf / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00001-of-00002.safetensors"}}))
    convert_fails(hf, tmp_path, CheckpointError, r"index\.json: names shard 'model-00001-of-00002\.safetensors', "
                                                 r"which is missing")


def test_unknown_architecture_refused_before_writing(hf, tmp_path):
    cfg = json.loads((hf / "config.json").read_text())
    cfg["model_type"] = "lama"
    (hf / "config.json").write_text(json.dumps(cfg))
    convert_fails(hf, tmp_path, UnsupportedArchitecture, r"model_type 'lama' is not supported; the closest "
                                                         r"supported family is 'llama'")


def test_missing_wrong_shape_and_unused_tensors(hf, tmp_path):
    from safetensors.numpy import load_file

    tensors = load_file(str(hf / "model.safetensors"))
    broken = dict(tensors)
    del broken["model.layers.1.mlp.up_proj.weight"]
    save_file(broken, str(hf / "model.safetensors"))
    convert_fails(hf, tmp_path, CheckpointError, r"tensor 'model\.layers\.1\.mlp\.up_proj\.weight' .* is missing")
    broken = dict(tensors, **{"model.norm.weight": np.ones(65, np.float32)})
    save_file(broken, str(hf / "model.safetensors"))
    convert_fails(hf, tmp_path, CheckpointError, r"tensor 'model\.norm\.weight' has shape \(65,\), expected \(64,\)")
    broken = dict(tensors, **{"model.layers.0.mystery.weight": np.ones(3, np.float32)})
    save_file(broken, str(hf / "model.safetensors"))
    convert_fails(hf, tmp_path, CheckpointError, r"tensor 'model\.layers\.0\.mystery\.weight' .* is not used")


# --- GGUF -------------------------------------------------------------------------------------------------------

def tiny_gguf(path, tensor_type=None):
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(1)
    w.add_token_list(["<unk>", "<s>", "</s>", "a"])
    w.add_tokenizer_model("llama")
    w.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_bad_magic(tmp_path):
    f = tiny_gguf(tmp_path / "m.gguf")
    f.write_bytes(b"GGUX" + f.read_bytes()[4:])
    convert_fails(f, tmp_path, CheckpointError, r"m\.gguf: bad magic b'GGUX'")


def test_gguf_truncated_header(tmp_path):
    f = tiny_gguf(tmp_path / "m.gguf")
    f.write_bytes(f.read_bytes()[:60])
    convert_fails(f, tmp_path, CheckpointError, r"m\.gguf: GGUF header is truncated")


def test_gguf_tensor_data_past_the_end(tmp_path):
    f = tiny_gguf(tmp_path / "m.gguf")
    f.write_bytes(f.read_bytes()[:-64])
    convert_fails(f, tmp_path, CheckpointError, r"tensor '(token_embd|output_norm)\.weight' data ends at byte \d+, "
                                                r"past the end")


def test_gguf_unknown_tensor_type(tmp_path):
    f = tiny_gguf(tmp_path / "m.gguf")
    data = bytearray(f.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4 + 8  # past the name, n_dims (u32) and the one dim (u64)
    assert struct.unpack_from("<I", data, at)[0] == 0  # F32
    struct.pack_into("<I", data, at, 77)
    f.write_bytes(bytes(data))
    convert_fails(f, tmp_path, CheckpointError, r"tensor 'output_norm\.weight' has GGML type 77, which is unknown")


def gguf_with_metadata(path, key: str, value_type: int, payload: bytes):
    """tiny_gguf's file with one more metadata entry, written raw (so it can be malformed)."""
    data = bytearray(tiny_gguf(path).read_bytes())
    n_kv = struct.unpack_from("<Q", data, 16)[0]
    struct.pack_into("<Q", data, 16, n_kv + 1)
    entry = struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", value_type) + payload
    path.write_bytes(bytes(data[:24]) + entry + bytes(data[24:]))
    return path


@pytest.mark.parametrize("value_type,payload,message", [
    (4, struct.pack("<I", 0), r"'general\.alignment' is 0; expected a power of two"),
    (4, struct.pack("<I", 48), r"'general\.alignment' is 48; expected a power of two"),
    (8, struct.pack("<Q", 3) + b"\xff\xfe\xfd", r"metadata 'general\.alignment' is not UTF-8"),
    (9, struct.pack("<IQ", 9, 1), r"metadata 'general\.alignment' is an array of type 9, which is not supported"),
    (9, struct.pack("<IQ", 4, 1 << 60), r"GGUF header is truncated .* for metadata 'general\.alignment'"),
    (13, b"", r"metadata 'general\.alignment' has value type 13, which is unknown"),
])
def test_gguf_malformed_metadata_is_named(tmp_path, value_type, payload, message):
    """Malformed metadata (a zero or odd alignment, invalid UTF-8, nested or huge arrays, unknown value types) is a
    CheckpointError naming the file and the key, never a raw ZeroDivisionError, RecursionError or MemoryError."""
    f = gguf_with_metadata(tmp_path / "m.gguf", "general.alignment", value_type, payload)
    convert_fails(f, tmp_path, CheckpointError, r"m\.gguf: .*" + message)


def test_gguf_overflowing_tensor_dims_are_named(tmp_path):
    f = tiny_gguf(tmp_path / "m.gguf")
    data = bytearray(f.read_bytes())
    name = b"output_norm.weight"
    at = data.index(name) + len(name) + 4  # the one dim (u64)
    struct.pack_into("<Q", data, at, (1 << 64) - 32)
    f.write_bytes(bytes(data))
    convert_fails(f, tmp_path, CheckpointError, r"tensor 'output_norm\.weight' data ends at byte \d+, past the end")


def test_source_that_does_not_exist(tmp_path):
    convert_fails(tmp_path / "nope", tmp_path, CheckpointError, r"nope: no such file or folder")


def full_disk(path, data):
    raise OSError(28, "No space left on device")


def test_failed_save_on_the_writer_thread_reaches_the_caller(hf, tmp_path, monkeypatch):
    """A write that fails on a writer thread (a full disk, say) fails the conversion, leaving nothing."""
    from convert import writer

    monkeypatch.setattr(writer.CheckpointWriter, "_write_file", staticmethod(full_disk))
    convert_fails(hf, tmp_path, OSError, "No space left")


@pytest.mark.parametrize("entry,field", [
    ({"dtype": ["F32"], "shape": [4], "data_offsets": [0, 16]}, "dtype"),
    ({"dtype": "F32", "shape": [[4]], "data_offsets": [0, 16]}, "shape"),
    ({"dtype": "F32", "shape": [True, 4], "data_offsets": [0, 16]}, "shape"),
    ({"dtype": "F32", "shape": "4", "data_offsets": [0, 16]}, "shape"),
    ({"dtype": "F32", "shape": [4], "data_offsets": ["0", "16"]}, "data_offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [0, 8, 16]}, "data_offsets"),
    ({"dtype": "F32", "shape": [4], "data_offsets": [16, 0]}, "data_offsets"),
    ({"dtype": "F32", "shape": [2 ** 62, 2 ** 62], "data_offsets": [0, 16]}, "needs"),
    ("F32", "entry"),
])
def test_malformed_safetensors_header_fields_name_the_field(hf, tmp_path, entry, field):
    """Wrong JSON types, nested arrays, booleans as sizes and overflowing shapes are CheckpointErrors naming file,
    tensor and field; never a raw TypeError or OverflowError."""
    write_safetensors(hf / "model.safetensors", {"a": entry}, bytes(16))
    convert_fails(hf, tmp_path, CheckpointError, rf"model\.safetensors: tensor 'a' .*{field}")


def test_deeply_nested_or_odd_metadata_headers(hf, tmp_path):
    raw = b"[" * 100_000 + b"]" * 100_000  # json.loads raises RecursionError
    (hf / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw)
    convert_fails(hf, tmp_path, CheckpointError, r"model\.safetensors: header is not JSON")
    write_safetensors(hf / "model.safetensors", {"__metadata__": {"format": 1}})
    convert_fails(hf, tmp_path, CheckpointError, r"__metadata__ must map strings to strings")


def test_index_paths_and_symlinks_must_stay_inside_the_source(hf, tmp_path):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    shutil.move(str(hf / "model.safetensors"), outside / "weights.safetensors")
    names = list(__import__("safetensors").safe_open(str(outside / "weights.safetensors"), "np").keys())
    index = hf / "model.safetensors.index.json"
    index.write_text(json.dumps({"weight_map": {n: "../elsewhere/weights.safetensors" for n in names}}))
    convert_fails(hf, tmp_path, CheckpointError, r"outside the source folder")
    index.write_text(json.dumps({"weight_map": {n: str(outside / "weights.safetensors") for n in names}}))
    convert_fails(hf, tmp_path, CheckpointError, r"missing from")  # absolute names are never taken
    index.write_text(json.dumps({"weight_map": {names[0]: ["model.safetensors"]}}))
    convert_fails(hf, tmp_path, CheckpointError, r"weight_map must map tensor names to shard file names")
    index.unlink()
    (hf / "model.safetensors").symlink_to(outside / "weights.safetensors")
    convert_fails(hf, tmp_path, CheckpointError, r"model\.safetensors resolves to .*, outside the source folder")
    (hf / "model.safetensors").unlink()
    shutil.move(str(outside / "weights.safetensors"), hf / "model.safetensors")
    secret = outside / "secret.txt"
    secret.write_text("not for the checkpoint")
    (hf / "tokenizer_config.json").unlink(missing_ok=True)
    (hf / "tokenizer_config.json").symlink_to(secret)
    convert_fails(hf, tmp_path, CheckpointError, r"tokenizer_config\.json resolves to .*secret\.txt, outside")


def test_a_hub_cache_snapshot_whose_files_link_into_blobs_converts(hf, tmp_path):
    """The Hugging Face hub cache keeps files in <repo>/blobs/ and links them from <repo>/snapshots/<revision>/."""
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "0123abc"
    (repo / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for f in hf.iterdir():
        blob = repo / "blobs" / f"blob-{f.name}"
        shutil.copy(f, blob)
        (snapshot / f.name).symlink_to(Path("../../blobs") / blob.name)
    dst = convert_checkpoint(snapshot, tmp_path / "dst", progress=False).dst
    assert (dst / "day0jax.json").is_file()


def test_destination_inside_or_containing_the_source_is_refused(hf, tmp_path):
    for dst, where in ((hf, "is"), (hf / "converted", "is inside"), (tmp_path, "contains")):
        with pytest.raises(CheckpointError, match=f"the destination .* {where} the source"):
            convert_checkpoint(hf, dst, progress=False, force=True)
    assert (hf / "config.json").is_file() and (hf / "model.safetensors").is_file()


def test_force_replaces_only_a_checkpoint_or_an_empty_folder(hf, tmp_path):
    documents = tmp_path / "documents"
    documents.mkdir()
    (documents / "thesis.tex").write_text("years of work")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("keep me")
    (tmp_path / "link").symlink_to(documents)
    for dst in (documents, a_file, tmp_path / "link"):
        with pytest.raises(CheckpointError, match="replaces only a day0jax checkpoint folder"):
            convert_checkpoint(hf, dst, progress=False, force=True)
    assert (documents / "thesis.tex").read_text() == "years of work" and a_file.read_text() == "keep me"
    assert not list(tmp_path.glob(".*.tmp-*"))
    empty = tmp_path / "empty"
    empty.mkdir()
    assert (convert_checkpoint(hf, empty, progress=False, force=True).dst / "day0jax.json").is_file()
    convert_checkpoint(hf, empty, progress=False, force=True)  # over a checkpoint


def test_force_keeps_the_old_output_until_the_new_one_is_complete(hf, tmp_path, monkeypatch):
    from convert import writer

    dst = tmp_path / "dst"
    convert_checkpoint(hf, dst, progress=False)
    manifest = (dst / "day0jax.json").read_text()

    with monkeypatch.context() as m:
        m.setattr(writer.CheckpointWriter, "_write_file", staticmethod(full_disk))
        with pytest.raises(OSError):
            convert_checkpoint(hf, dst, progress=False, force=True)
    assert (dst / "day0jax.json").read_text() == manifest  # untouched
    assert not list(tmp_path.glob(".dst.tmp-*")) and not list(tmp_path.glob(".dst.old-*"))
    # A crash between a --force's two renames leaves the old output aside: the next conversion puts it back.
    dst.rename(tmp_path / ".dst.old-1234abcd")
    with pytest.raises(CheckpointError, match="already exists"):
        convert_checkpoint(hf, dst, progress=False)
    assert (dst / "day0jax.json").read_text() == manifest and not list(tmp_path.glob(".dst.old-*"))


def test_release_unmaps_the_pages_a_read_touched(tmp_path):
    """Tensors are views of a memory map; `release` must drop their pages from the process, or a conversion's
    resident memory grows to the size of the source."""
    from convert.safetensors_file import SafetensorsFile

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    path = tmp_path / "big.safetensors"
    save_file({"w": np.ones((64, 1 << 20), np.uint8)}, str(path))  # 64 MiB
    f = SafetensorsFile(path)
    before = rss()
    assert int(f.read("w").sum(dtype=np.int64)) == 64 << 20  # touches every page
    touched = rss()
    f.release()
    released = rss()
    assert touched - before > 48 << 20, (before, touched)
    assert touched - released > 48 << 20, (touched, released)
