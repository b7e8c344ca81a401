"""The GGUF tensor index (backends.lowering.gguf_index) against gguf's own reader: the same tensors,
block types, shapes and bytes, on the default model's file and on a file written by gguf's writer with
every metadata value type and a non-default alignment; refusals for files that are not GGUF."""

import os

import gguf
import numpy as np
import pytest

from specpass.backends.lowering.gguf_index import read_index
from specpass.common.errors import InvalidParameterError
from specpass.models import GGUF_FILE, default_model_dir


def assert_same_as_gguf_reader(path: str) -> int:
    index = read_index(path)
    reader = gguf.GGUFReader(path)
    field = reader.fields["general.architecture"]
    assert index.architecture == bytes(field.parts[field.data[0]]).decode()
    assert list(index.tensors) == [t.name for t in reader.tensors]
    for expected in reader.tensors:
        got = index.tensors[expected.name]
        assert got.block_type == expected.tensor_type.name
        assert got.shape == tuple(int(n) for n in expected.shape)
        assert got.data.dtype == np.uint8 and got.data.shape[0] == int(np.prod(expected.shape[1:]))
        assert np.array_equal(got.data.reshape(-1), np.asarray(expected.data).view(np.uint8).reshape(-1))
    return len(index.tensors)


def test_the_index_reads_the_default_models_file_as_gguf_does():
    assert assert_same_as_gguf_reader(os.path.join(default_model_dir(), GGUF_FILE)) == 272


def test_the_index_skips_every_metadata_value_type(tmp_path):
    path = str(tmp_path / "tiny.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_uint8("a.u8", 7)
    writer.add_int64("a.i64", -3)
    writer.add_float64("a.f64", 0.5)
    writer.add_bool("a.bool", True)
    writer.add_string("a.string", "héllo")
    writer.add_array("a.strings", ["x", "yy", "", "zzz"])
    writer.add_array("a.ints", [1, 2, 3])
    writer.add_custom_alignment(64)
    rng = np.random.default_rng(0)
    weights = rng.normal(size=(8, 64)).astype(np.float32)
    for name, kind in (("blk.0.attn_q.weight", "Q4_0"), ("blk.0.attn_k.weight", "Q8_0")):
        qtype = gguf.GGMLQuantizationType[kind]
        writer.add_tensor(name, gguf.quants.quantize(weights, qtype), raw_dtype=qtype)
    writer.add_tensor("output_norm.weight", rng.normal(size=5).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert assert_same_as_gguf_reader(path) == 3
    index = read_index(path)
    assert index.tensors["blk.0.attn_q.weight"].block_type == "Q4_0" and index.tensors["blk.0.attn_q.weight"].shape == (64, 8)


def test_files_that_are_not_gguf_are_refused(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(64))
    with pytest.raises(InvalidParameterError, match="not a GGUF file"):
        read_index(str(other))
    whole = open(os.path.join(default_model_dir(), GGUF_FILE), "rb").read(4096)
    other.write_bytes(whole)  # the header cut inside the tokenizer's strings
    with pytest.raises(InvalidParameterError, match="not a GGUF file specpass can read: the file ends inside its header"):
        read_index(str(other))
