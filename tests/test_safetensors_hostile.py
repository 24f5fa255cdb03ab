"""Hostile safetensors files and HF directories, on real files: each is refused with
FormatError where the reference loader (the `safetensors` package) refuses it, nothing is
read from outside the model directory, and no error quotes a file's bytes."""

import json
import os
import re
import struct

import numpy as np
import pytest
import safetensors
import safetensors.numpy
from etils import epath

import jaxckpt
from jaxckpt import errors
from jaxckpt.hf import _format as st

INDEX = "model.safetensors.index.json"
E = b'"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}'  # one valid entry, 4 bytes of data
TARGET = {"a": np.zeros(4, np.uint8)}


def encode(header, data: bytes = b"") -> bytes:
    """A safetensors file: `header` a dict (dumped) or raw bytes, padded with spaces to 8."""
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def tensor(dtype="U8", shape=(4,), offsets=(0, 4)):
    return {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}


def with_entry(**fields) -> bytes:
    """One tensor `a` with 4 bytes of data whose entry fields are replaced by `fields`."""
    return encode({"a": {**tensor(), **fields}}, b"\0" * 4)


def extra_field(raw_json: bytes) -> bytes:
    """A valid tensor with an unknown field (safetensors ignores those) holding `raw_json`."""
    return encode(
        b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4],"x":' + raw_json + b"}}", b"\0" * 4
    )


def reference_loads(path) -> dict:
    with safetensors.safe_open(path, "np") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)


# Every file here is refused by safetensors 0.8.0 (asserted in the test, so a change in the
# reference shows up here).
HOSTILE = {
    # the 8-byte length
    "shorter_than_8_bytes": b"\x01\x02",
    "header_length_past_the_file": struct.pack("<Q", 100) + b"{}",
    "header_length_over_100MB": struct.pack("<Q", 100_000_001) + b"{}" + b" " * 6,
    "header_length_2**64-1": struct.pack("<Q", 2**64 - 1) + b"{}" + b" " * 6,
    "empty_header": struct.pack("<Q", 0),
    # the JSON text
    "not_utf8": encode(b'{"a\xff":' + E[4:] + b"}", b"\0" * 4),
    "utf8_bom": encode(b"\xef\xbb\xbf{" + E + b"}", b"\0" * 4),
    "utf16": encode(("{" + E.decode() + "}").encode("utf-16-le"), b"\0" * 4),
    "trailing_comma": encode(b"{" + E + b",}", b"\0" * 4),
    "trailing_nul_padding": encode(b"{" + E + b"}\0\0\0", b"\0" * 4),
    "second_json_value": encode(b"{" + E + b"}{}", b"\0" * 4),
    "comment": encode(b"{" + E + b"}//", b"\0" * 4),
    "control_character_in_a_name": encode(b'{"a\x01":' + E[4:] + b"}", b"\0" * 4),
    "lone_surrogate_in_a_name": encode(b'{"\\ud800":' + E[4:] + b"}", b"\0" * 4),
    "lone_surrogate_in_metadata": encode(b'{"__metadata__":{"k":"\\udc00"},' + E + b"}", b"\0" * 4),
    "nan": extra_field(b"NaN"),
    "infinity": extra_field(b"-Infinity"),
    "float_out_of_range": extra_field(b"1e309"),
    "int_out_of_float_range_310_digits": extra_field(b"1" + b"0" * 309),
    "int_of_5000_digits_in_a_shape": encode(
        b'{"a":{"dtype":"U8","shape":[' + b"9" * 5000 + b'],"data_offsets":[0,4]}}', b"\0" * 4
    ),
    "nested_128_deep": extra_field(b"[" * 126 + b"]" * 126),  # + header and entry objects
    "nested_100000_deep": extra_field(b"[" * 100_000 + b"]" * 100_000),
    "duplicate___metadata__": encode(
        b'{"__metadata__":{},"__metadata__":{},' + E + b"}", b"\0" * 4
    ),
    "duplicate_field_in_an_entry": encode(
        b'{"a":{"dtype":"U8","dtype":"U8","shape":[4],"data_offsets":[0,4]}}', b"\0" * 4
    ),
    # the header's structure
    "header_is_a_list": encode(b"[]"),
    "header_is_a_string": encode(b'"x"'),
    "header_is_a_number": encode(b"1"),
    "metadata_0": encode({"__metadata__": 0, "a": tensor()}, b"\0" * 4),
    "metadata_list": encode({"__metadata__": [], "a": tensor()}, b"\0" * 4),
    "metadata_string": encode({"__metadata__": "x", "a": tensor()}, b"\0" * 4),
    "metadata_int_value": encode({"__metadata__": {"k": 1}, "a": tensor()}, b"\0" * 4),
    "metadata_null_value": encode({"__metadata__": {"k": None}, "a": tensor()}, b"\0" * 4),
    "metadata_object_value": encode({"__metadata__": {"k": {}}, "a": tensor()}, b"\0" * 4),
    "entry_is_a_number": encode({"a": 5}),
    "entry_is_a_list": encode({"a": [0, 4]}),
    "no_dtype": encode({"a": {"shape": [4], "data_offsets": [0, 4]}}, b"\0" * 4),
    "no_shape": encode({"a": {"dtype": "U8", "data_offsets": [0, 4]}}, b"\0" * 4),
    "no_data_offsets": encode({"a": {"dtype": "U8", "shape": [4]}}, b"\0" * 4),
    "dtype_lowercase": with_entry(dtype="f32"),
    "dtype_null": with_entry(dtype=None),
    "dtype_int": with_entry(dtype=1),
    "shape_negative": with_entry(shape=[-1, -4]),
    "shape_bool": encode({"a": tensor(shape=[True], offsets=[0, 1])}, b"\0"),
    "shape_float": with_entry(shape=[4.0]),
    "shape_exponent": encode(b'{"a":{"dtype":"U8","shape":[4e0],"data_offsets":[0,4]}}', b"\0" * 4),
    "shape_minus_zero": encode(b'{"a":{"dtype":"U8","shape":[-0],"data_offsets":[0,0]}}'),
    "shape_string": with_entry(shape=["4"]),
    "shape_nested_list": with_entry(shape=[[4]]),
    "shape_not_a_list": with_entry(shape=4),
    "shape_null": with_entry(shape=None),
    "shape_2**64": encode({"a": tensor(shape=[2**64, 0], offsets=[0, 0])}),
    "offsets_negative": encode({"a": tensor(shape=[0], offsets=[-1, -1])}),
    "offsets_bool": encode({"a": tensor(shape=[1], offsets=[False, True])}, b"\0"),
    "offsets_float": with_entry(data_offsets=[0.0, 4.0]),
    "offsets_strings": with_entry(data_offsets=["0", "4"]),
    "offsets_one": with_entry(data_offsets=[4]),
    "offsets_three": with_entry(data_offsets=[0, 4, 4]),
    "offsets_object": with_entry(data_offsets={"begin": 0}),
    "offsets_null": with_entry(data_offsets=None),
    "offsets_2**64": encode({"a": tensor(shape=[0], offsets=[2**64, 2**64])}),
    # offsets against the data
    "end_before_begin": encode({"a": tensor(shape=[0], offsets=[4, 0]), "b": tensor()}, b"\0" * 4),
    "gap_before_a_tensor": encode({"a": tensor(offsets=[1, 5])}, b"\0" * 5),
    "overlapping_tensors": encode(
        {"a": tensor(), "b": tensor(shape=[2], offsets=[2, 4])}, b"\0" * 4
    ),
    "bytes_after_the_last_tensor": encode({"a": tensor()}, b"\0" * 5),
    "truncated_data": encode({"a": tensor()}, b"\0" * 3),
    "size_does_not_match_shape": encode({"a": tensor(shape=[3])}, b"\0" * 4),
    "element_count_overflows_before_a_0": encode(
        {"a": tensor(shape=[2**63, 4, 0], offsets=[0, 0])}
    ),
    "size_in_bits_overflows": encode({"a": tensor(shape=[2**61], offsets=[0, 0])}),
    "size_in_bytes_overflows": encode({"a": tensor("F64", shape=[2**62], offsets=[0, 0])}),
}


@pytest.mark.parametrize("data", HOSTILE.values(), ids=HOSTILE.keys())
def test_hostile_file_refused_like_the_reference(tmp_path, data):
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(safetensors.SafetensorError):
        reference_loads(path)
    with pytest.raises(errors.FormatError):
        st.read_header(path)
    with pytest.raises(errors.FormatError):
        jaxckpt.load_safetensors(path, TARGET)
    with pytest.raises(errors.FormatError):
        jaxckpt.load_safetensors(tmp_path, TARGET)  # as an HF directory


# safetensors keeps the last of two equal keys; jaxckpt refuses them, since a reader that
# keeps the first (a scanner, say) would see another tensor than the one loaded.
STRICTER = {
    "duplicate_tensor_name": encode(
        b'{"a":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
        b'"a":{"dtype":"I32","shape":[1],"data_offsets":[0,4]}}',
        b"\0" * 4,
    ),
    "duplicate_metadata_key": encode(b'{"__metadata__":{"k":"1","k":"2"},' + E + b"}", b"\0" * 4),
}


@pytest.mark.parametrize("data", STRICTER.values(), ids=STRICTER.keys())
def test_a_key_twice_in_one_object_is_refused(tmp_path, data):
    path = tmp_path / "model.safetensors"
    path.write_bytes(data)
    with pytest.raises(errors.FormatError, match="appears twice"):
        st.read_header(path)


# Accepted by the reference and by jaxckpt alike: the checks above refuse no valid file.
ACCEPTED = {
    "metadata_null": encode({"__metadata__": None, "a": tensor()}, b"\1\2\3\4"),
    "metadata_empty": encode({"__metadata__": {}, "a": tensor()}, b"\1\2\3\4"),
    "leading_and_trailing_whitespace": encode(b" \n\t{" + E + b"}\r\n", b"\1\2\3\4"),
    "unknown_field_in_an_entry": extra_field(b'{"k": [1.5, -5, null, true, "s"]}'),
    "nested_127_deep": extra_field(b"[" * 125 + b"]" * 125),
    "int_of_309_digits": extra_field(b"1" + b"0" * 308),
    "surrogate_pair_in_a_name": encode(b'{"\\ud83d\\ude00":' + E[4:] + b"}", b"\1\2\3\4"),
    "empty_and_nul_names": encode(
        {"": tensor(offsets=[0, 4]), "\0": tensor(shape=[0], offsets=[4, 4])}, b"\1\2\3\4"
    ),
    "zero_size_tensors_at_one_offset": encode(
        {
            "z1": tensor(shape=[0], offsets=[0, 0]),
            "z2": tensor(shape=[2, 0], offsets=[0, 0]),
            "a": tensor(offsets=[0, 4]),
        },
        b"\1\2\3\4",
    ),
    "no_tensors": encode({}),
    "scalar": encode({"s": tensor("F32", shape=[], offsets=[0, 4])}, np.float32(2.5).tobytes()),
}


@pytest.mark.parametrize("data", ACCEPTED.values(), ids=ACCEPTED.keys())
def test_valid_edge_cases_load_like_the_reference(tmp_path, data):
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    expected = reference_loads(path)
    tensors, _ = st.read_header(path)
    assert sorted(tensors) == sorted(expected)
    for name, info in tensors.items():
        assert info.shape == expected[name].shape and info.dtype == expected[name].dtype
        if info.nbytes:
            got = st.read_slice(path, info, tuple(slice(None) for _ in info.shape))
            np.testing.assert_array_equal(got, expected[name])


def test_a_valid_dtype_jaxckpt_cannot_load_is_named(tmp_path):
    path = tmp_path / "x.safetensors"
    path.write_bytes(encode({"a": tensor("F8_E8M0")}, b"\0" * 4))
    with safetensors.safe_open(path, "np") as f:
        assert list(f.keys()) == ["a"]  # the reference reads the header
    with pytest.raises(errors.UnsupportedValueError, match="dtype F8_E8M0: valid safetensors"):
        st.read_header(path)


def test_files_written_by_the_reference_load(tmp_path):
    arrays = {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4),
        "f16": np.ones((2, 2), np.float16),
        "i64": np.array([-(2**62), 7]),
        "u8": np.arange(5, dtype=np.uint8),
        "b": np.array([True, False]),
        "empty": np.zeros((0, 3), np.float32),
        "scalar": np.array(1.5, np.float64),
    }
    safetensors.numpy.save_file(arrays, tmp_path / "model.safetensors", metadata={"format": "np"})
    tensors, metadata = st.read_header(tmp_path / "model.safetensors")
    assert metadata == {"format": "np"} and sorted(tensors) == sorted(arrays)
    loaded = jaxckpt.load_safetensors(tmp_path, {k: np.zeros_like(v) for k, v in arrays.items()})
    for name, value in arrays.items():
        np.testing.assert_array_equal(loaded[name], value)


# ---------------------------------------------------------------- errors never quote the bytes


def test_errors_never_quote_the_bytes_of_a_file_that_is_not_safetensors(tmp_path):
    secret = tmp_path / "environ"
    secret.write_bytes(b"AWS_SECRET_ACCESS_KEY=hunter2hunter2\0HOME=/root\0" * 4)
    with pytest.raises(errors.FormatError, match="does not fit the file") as e:
        jaxckpt.load_safetensors(secret, TARGET)  # the user's own choice of file
    (length,) = struct.unpack("<Q", b"AWS_SECR")
    assert str(length) not in str(e.value) and "AWS" not in str(e.value)
    for system_file in ("/etc/passwd", "/proc/self/environ"):
        if os.path.isfile(system_file):
            with pytest.raises(errors.FormatError) as e:
                jaxckpt.load_safetensors(system_file, TARGET)
            with open(system_file, "rb") as f:
                head = f.read(8)
            if len(head) == 8:
                assert str(struct.unpack("<Q", head)[0]) not in str(e.value)
            text = str(e.value).replace(system_file, "")
            assert head[:4].decode(errors="replace") not in text


@pytest.mark.parametrize(
    "data, secret",
    [
        (encode(b'{"a\xff":' + E[4:] + b"}", b"\0" * 4), ["xff", "0xff", "\\xff"]),
        (with_entry(shape="SECRET-shape"), ["SECRET"]),
        (with_entry(dtype="SECRET-dtype"), ["SECRET"]),
        (with_entry(data_offsets=["SECRET", 4]), ["SECRET"]),
        (encode({"__metadata__": {"k": ["SECRET"]}, "a": tensor()}, b"\0" * 4), ["SECRET"]),
        (encode({"a": "SECRET-entry"}), ["SECRET"]),
    ],
    ids=["bad_utf8_byte", "shape", "dtype", "offsets", "metadata", "entry"],
)
def test_errors_never_quote_header_values(tmp_path, data, secret):
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    with pytest.raises(errors.FormatError) as e:
        st.read_header(path)
    assert not any(s in str(e.value) for s in secret), str(e.value)


def test_a_long_hostile_tensor_name_is_shortened_and_escaped(tmp_path):
    name = "\x1b[2J" + "n" * 10_000
    path = tmp_path / "x.safetensors"
    path.write_bytes(encode({name: tensor(shape=[3])}, b"\0" * 4))
    with pytest.raises(errors.FormatError, match=r"tensor '\\x1b\[2Jn+\.\.\.'") as e:
        st.read_header(path)
    assert len(str(e.value)) < 400 and "\x1b" not in str(e.value)


# ---------------------------------------------------------------------------------- the index


def shards(directory, files: dict[str, dict[str, np.ndarray]], weight_map=None, **index):
    """Writes safetensors shards with the reference writer and an index (weight_map from
    the shards unless given; extra top-level index keys from `index`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name, arrays in files.items():
        safetensors.numpy.save_file(arrays, directory / name)
    if weight_map is None:
        weight_map = {t: name for name, arrays in files.items() for t in arrays}
    body = {"metadata": {"total_size": 8}, "weight_map": weight_map, **index}
    (directory / INDEX).write_text(json.dumps(body))
    return directory


TWO = {
    "model-00001-of-00002.safetensors": {"a": np.arange(4, dtype=np.uint8)},
    "model-00002-of-00002.safetensors": {"b": np.arange(4, dtype=np.uint8) + 4},
}
FIRST, SECOND = TWO
TWO_TARGET = {"a": np.zeros(4, np.uint8), "b": np.zeros(4, np.uint8)}


MAP = dict(zip("ab", TWO, strict=True))


@pytest.mark.parametrize(
    "index",
    [
        {"metadata": {"total_size": 8}, "weight_map": MAP},
        {"weight_map": MAP},
        {"metadata": {"total_parameters": 8, "total_size": 8}, "weight_map": MAP},
        {"metadata": {"total_size": 8.125}, "weight_map": MAP},
        {"weight_map": {"a": "./" + MAP["a"], "b": MAP["b"]}},
    ],
    # transformers writes total_parameters too; older transformers counted a bool as 1/8
    # byte, so a float total_size
    ids=["jaxckpt", "no_metadata", "transformers", "float_total_size", "dot_slash"],
)
def test_valid_indexes_load(tmp_path, index):
    shards(tmp_path, TWO)
    (tmp_path / INDEX).write_text(json.dumps(index))
    loaded = jaxckpt.load_safetensors(tmp_path, TWO_TARGET)
    np.testing.assert_array_equal(loaded["b"], np.arange(4) + 4)


BAD_INDEXES = {
    "not_an_object": (b"[]", "weight_map is an object"),
    "no_weight_map": (b'{"metadata": {}}', "weight_map is an object"),
    "weight_map_a_list": (json.dumps({"weight_map": list(MAP.items())}), "weight_map is an object"),
    "weight_map_empty": (b'{"weight_map": {}}', "names no tensors"),
    "file_name_an_int": (json.dumps({"weight_map": {**MAP, "b": 2}}), "other than a file name"),
    "file_name_null": (json.dumps({"weight_map": {**MAP, "b": None}}), "other than a file name"),
    "metadata_a_list": (
        json.dumps({"metadata": [], "weight_map": MAP}),
        "metadata is not an object",
    ),
    "total_size_negative": (
        json.dumps({"metadata": {"total_size": -1}, "weight_map": MAP}),
        "total_size",
    ),
    "total_size_string": (
        json.dumps({"metadata": {"total_size": "8"}, "weight_map": MAP}),
        "total_size",
    ),
    "total_size_bool": (
        json.dumps({"metadata": {"total_size": True}, "weight_map": MAP}),
        "total_size",
    ),
    "not_json": (b'{"weight_map": ', "not valid JSON"),
    "not_utf8": (b'{"weight_map": {"\xff": "x"}}', "not valid JSON: not UTF-8"),
    "nan": (b'{"metadata": {"total_size": NaN}, "weight_map": {}}', "not valid JSON"),
    "nested_100000_deep": (b'{"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested more than"),
    "int_of_5000_digits": (b'{"metadata": {"total_size": ' + b"9" * 5000 + b"}}", "out of range"),
    "tensor_twice_in_the_weight_map": (
        b'{"weight_map": {"a": "%s", "b": "%s", "a": "%s"}}'
        % tuple(s.encode() for s in [*TWO, SECOND]),
        "appears twice",
    ),
    "shard_missing": (
        json.dumps({"weight_map": {**MAP, "c": "model-00003.safetensors"}}),
        "cannot open",
    ),
    "names_a_tensor_its_shard_lacks": (
        json.dumps({"weight_map": {**MAP, "c": SECOND}}),
        r"puts 'c' in 'model-00002-of-00002.safetensors', which does not hold",
    ),
}


@pytest.mark.parametrize("text, message", BAD_INDEXES.values(), ids=BAD_INDEXES.keys())
def test_malformed_index_is_a_format_error(tmp_path, text, message):
    shards(tmp_path, TWO)
    (tmp_path / INDEX).write_bytes(text if isinstance(text, bytes) else text.encode())
    with pytest.raises(errors.FormatError, match=message):
        jaxckpt.load_safetensors(tmp_path, TWO_TARGET)


def test_a_shard_tensor_the_index_does_not_name_for_it_is_refused(tmp_path):
    files = {
        "model-00001-of-00002.safetensors": {"a": np.zeros(4, np.uint8), "c": np.ones(2, np.uint8)},
        "model-00002-of-00002.safetensors": {"b": np.zeros(4, np.uint8)},
    }
    shards(tmp_path, files, weight_map={"a": FIRST, "b": SECOND})
    with pytest.raises(
        errors.FormatError,
        match=r"'model-00001-of-00002.safetensors' holds 'c', which .* does not put in that file",
    ):
        jaxckpt.load_safetensors(tmp_path, TWO_TARGET, ignore="c")


def test_a_tensor_in_two_shards_is_refused(tmp_path):
    files = {
        "model-00001-of-00002.safetensors": {"a": np.zeros(4, np.uint8)},
        "model-00002-of-00002.safetensors": {"a": np.ones(4, np.uint8), "b": np.ones(4, np.uint8)},
    }
    shards(tmp_path, files, weight_map={"a": FIRST, "b": SECOND})
    with pytest.raises(
        errors.FormatError, match=r"'a' is in both 'model-00001.*' and 'model-00002"
    ):
        jaxckpt.load_safetensors(tmp_path, TWO_TARGET)


# ---------------------------------------------------------- only regular files inside the directory


@pytest.fixture
def outside(tmp_path):
    """A valid safetensors file outside the model directory (tmp_path / "model")."""
    directory = tmp_path / "outside"
    directory.mkdir()
    safetensors.numpy.save_file({"b": np.full(4, 66, np.uint8)}, directory / "x.safetensors")
    return directory / "x.safetensors"


def model_dir(tmp_path, weight_map_b: str):
    """tmp_path / "model": shard 1 holds 'a'; the index puts 'b' in `weight_map_b`."""
    first = FIRST
    return shards(
        tmp_path / "model", {first: TWO[first]}, weight_map={"a": first, "b": weight_map_b}
    )


@pytest.mark.parametrize(
    "name, message",
    [
        ("../outside/x.safetensors", "without '..'"),
        ("sub/../../outside/x.safetensors", "without '..'"),
        ("..\\outside\\x.safetensors", "without '..'"),
        ("ABSOLUTE", "without '..'"),
        ("file://x.safetensors", "without '..'"),
        ("", "without '..'"),
        ("x\0.safetensors", "without '..'"),
    ],
    ids=["dotdot", "sub_dotdot", "backslash_dotdot", "absolute", "url", "empty", "nul"],
)
def test_weight_map_names_outside_the_directory_are_refused(tmp_path, outside, name, message):
    name = str(outside) if name == "ABSOLUTE" else name
    directory = model_dir(tmp_path, name)
    with pytest.raises(errors.FormatError, match=message):
        jaxckpt.load_safetensors(directory, TWO_TARGET)


@pytest.mark.parametrize("how", ["relative", "absolute", "through_a_linked_folder", "index"])
def test_links_out_of_the_directory_are_refused(tmp_path, outside, how):
    if how == "through_a_linked_folder":
        directory = model_dir(tmp_path, "sub/x.safetensors")
        (directory / "sub").symlink_to("../outside")
    elif how == "index":  # the index itself links out, to an index naming the outside shard
        directory = model_dir(tmp_path, "x.safetensors")
        (outside.parent / INDEX).write_bytes((directory / INDEX).read_bytes())
        (directory / INDEX).unlink()
        (directory / INDEX).symlink_to(outside.parent / INDEX)
    else:
        directory = model_dir(tmp_path, "link.safetensors")
        target = outside if how == "absolute" else "../outside/x.safetensors"
        (directory / "link.safetensors").symlink_to(target)
    with pytest.raises(
        errors.FormatError,
        match=f"leads to '{re.escape(str(outside.parent))}/.*', outside {re.escape(str(directory))};",
    ):
        jaxckpt.load_safetensors(directory, TWO_TARGET)


def test_a_single_file_linking_out_is_refused_unless_named_by_the_user(tmp_path, outside):
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model.safetensors").symlink_to(outside)
    target = {"b": np.zeros(4, np.uint8)}
    with pytest.raises(errors.FormatError, match="outside"):
        jaxckpt.load_safetensors(directory, target)
    # a file the user names is their choice, link or not
    loaded = jaxckpt.load_safetensors(directory / "model.safetensors", target)
    np.testing.assert_array_equal(loaded["b"], np.full(4, 66))


def test_a_secret_linked_into_the_directory_is_not_read(tmp_path):
    secret = tmp_path / "environ"
    secret.write_bytes(b"AWS_SECRET_ACCESS_KEY=hunter2" * 10)
    directory = tmp_path / "model"
    directory.mkdir()
    (directory / "model.safetensors").symlink_to(secret)
    with pytest.raises(errors.FormatError, match="outside") as e:
        jaxckpt.load_safetensors(directory, TARGET)
    assert "AWS" not in str(e.value)
    (directory / "model.safetensors").unlink()
    if os.path.exists("/etc/passwd"):
        (directory / "model.safetensors").symlink_to("/etc/passwd")
        with pytest.raises(errors.FormatError, match="outside") as e:
            jaxckpt.load_safetensors(directory, TARGET)
        assert "root" not in str(e.value).replace(str(tmp_path), "")


def test_links_inside_the_directory_are_followed(tmp_path):
    (tmp_path / "model" / "real").mkdir(parents=True)
    directory = shards(tmp_path / "model", {"real/one.safetensors": TWO[FIRST]})
    safetensors.numpy.save_file(TWO[SECOND], directory / "real" / "two.safetensors")
    (directory / "two.safetensors").symlink_to("real/two.safetensors")
    (directory / INDEX).write_text(
        json.dumps({"weight_map": {"a": "real/one.safetensors", "b": "two.safetensors"}})
    )
    loaded = jaxckpt.load_safetensors(directory, TWO_TARGET)
    np.testing.assert_array_equal(loaded["b"], np.arange(4) + 4)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("where", ["shard", "single_file", "index", "given_path"])
def test_a_fifo_is_refused_without_blocking(tmp_path, where):
    directory = tmp_path / "model"
    if where == "shard":
        model_dir(tmp_path, "fifo.safetensors")
        os.mkfifo(directory / "fifo.safetensors")
        path = directory
    elif where == "index":
        directory.mkdir()
        os.mkfifo(directory / INDEX)
        path = directory
    else:
        directory.mkdir()
        os.mkfifo(directory / "model.safetensors")
        path = directory if where == "single_file" else directory / "model.safetensors"
    with pytest.raises(errors.FormatError, match="is a FIFO, not a regular file"):
        jaxckpt.load_safetensors(path, TWO_TARGET)


def test_devices_directories_dangling_links_and_loops_are_refused(tmp_path):
    if os.path.exists("/dev/zero"):
        link = tmp_path / "zero.safetensors"
        link.symlink_to("/dev/zero")
        with pytest.raises(errors.FormatError, match="is a character device, not a regular file"):
            jaxckpt.load_safetensors(link, TARGET)  # the user's link: followed, still refused
    directory = model_dir(tmp_path, "folder.safetensors")
    (directory / "folder.safetensors").mkdir()
    with pytest.raises(errors.FormatError, match="is a directory, not a regular file"):
        jaxckpt.load_safetensors(directory, TWO_TARGET)
    (directory / "folder.safetensors").rmdir()
    (directory / "folder.safetensors").symlink_to("missing.safetensors")
    with pytest.raises(errors.FormatError, match=r"cannot open .*missing\.safetensors"):
        jaxckpt.load_safetensors(directory, TWO_TARGET)
    (directory / "folder.safetensors").unlink()
    (directory / "folder.safetensors").symlink_to("loop.safetensors")
    (directory / "loop.safetensors").symlink_to("folder.safetensors")
    with pytest.raises(errors.FormatError, match="symbolic link"):
        jaxckpt.load_safetensors(directory, TWO_TARGET)


def test_a_file_swapped_after_its_header_was_read_is_not_read(tmp_path, outside):
    """Data reads (the memory map) go through the same checked open as the header."""
    path = tmp_path / "x.safetensors"
    safetensors.numpy.save_file({"b": np.arange(4, dtype=np.uint8)}, path)
    tensors, _ = st.read_header(path)
    whole = (slice(None),)
    np.testing.assert_array_equal(st.read_slice(path, tensors["b"], whole), np.arange(4))
    os.replace(outside, path)  # another file, same size
    with pytest.raises(errors.FormatError, match="replaced or truncated"):
        st.read_slice(path, tensors["b"], whole)
    path.unlink()
    path.symlink_to(tmp_path / "outside")
    with pytest.raises(errors.FormatError, match="is a symbolic link"):
        st.read_slice(path, tensors["b"], whole)
    path.unlink()
    os.mkfifo(path)
    with pytest.raises(errors.FormatError, match="is a FIFO"):
        st.read_slice(path, tensors["b"], whole)


# ------------------------------------------------------------ the hub cache: allowed on purpose


def hub_snapshot(cache, files: dict[str, bytes]):
    """`cache/models--org--name` as huggingface_hub lays it out: blobs named by hash, the
    snapshot's files relative links to them."""
    repo = cache / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / ("0123456789abcdef" * 2 + "01234567")
    snapshot.mkdir(parents=True)
    for i, (name, data) in enumerate(files.items()):
        (repo / "blobs" / f"{i:064x}").write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{i:064x}")
    return repo, snapshot


def saved(arrays) -> bytes:
    return safetensors.numpy.save(arrays)


def test_a_hub_cache_snapshot_loads_through_its_blob_links(tmp_path):
    _, single = hub_snapshot(tmp_path / "one", {"model.safetensors": saved(TWO[FIRST])})
    loaded = jaxckpt.load_safetensors(single, {"a": np.zeros(4, np.uint8)})
    np.testing.assert_array_equal(loaded["a"], np.arange(4))
    files = {name: saved(arrays) for name, arrays in TWO.items()}
    files[INDEX] = json.dumps({"metadata": {"total_size": 8}, "weight_map": MAP}).encode()
    _, sharded = hub_snapshot(tmp_path / "two", files)
    loaded = jaxckpt.load_safetensors(sharded, TWO_TARGET)
    np.testing.assert_array_equal(loaded["b"], np.arange(4) + 4)


def test_a_hub_cache_snapshot_may_not_link_out_of_its_repo(tmp_path, outside):
    repo, snapshot = hub_snapshot(tmp_path / "cache", {"model.safetensors": saved(TWO[FIRST])})
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(outside)
    with pytest.raises(errors.FormatError, match=f"outside {re.escape(str(repo))};"):
        jaxckpt.load_safetensors(snapshot, {"b": np.zeros(4, np.uint8)})
    # without a blobs folder, a snapshots/<rev> folder is an ordinary directory
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(f"../../blobs/{0:064x}")
    loaded = jaxckpt.load_safetensors(snapshot, {"a": np.zeros(4, np.uint8)})
    np.testing.assert_array_equal(loaded["a"], np.arange(4))
    os.rename(repo / "blobs", repo / "elsewhere")
    (snapshot / "model.safetensors").unlink()
    (snapshot / "model.safetensors").symlink_to(f"../../elsewhere/{0:064x}")
    with pytest.raises(errors.FormatError, match=f"outside {re.escape(str(snapshot))};"):
        jaxckpt.load_safetensors(snapshot, {"a": np.zeros(4, np.uint8)})


# ---------------------------------------------------------------------------------- gs://


@pytest.mark.parametrize(
    "name",
    ["../x.safetensors", "/x.safetensors", "a/../../x.safetensors", "gs://other/x.safetensors"],
)
def test_weight_map_names_escaping_a_gcs_directory_are_refused(gcs_dir, name):
    remote = epath.Path(gcs_dir)
    (remote / "x.safetensors").write_bytes(saved({"b": np.zeros(4, np.uint8)}))
    hf = remote / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    (hf / "model-00001.safetensors").write_bytes(saved({"a": np.zeros(4, np.uint8)}))
    index = {"weight_map": {"a": "model-00001.safetensors", "b": name}}
    (hf / INDEX).write_text(json.dumps(index))
    with pytest.raises(errors.FormatError, match=r"without '\.\.'"):
        jaxckpt.load_safetensors(str(hf), TWO_TARGET)


def test_a_sharded_gcs_directory_still_loads(gcs_dir):
    hf = epath.Path(gcs_dir) / "hf"
    hf.mkdir(parents=True, exist_ok=True)
    for name, arrays in TWO.items():
        (hf / name).write_bytes(saved(arrays))
    (hf / INDEX).write_text(json.dumps({"metadata": {"total_size": 8}, "weight_map": MAP}))
    loaded = jaxckpt.load_safetensors(str(hf), TWO_TARGET)
    np.testing.assert_array_equal(loaded["b"], np.arange(4) + 4)
    single = jaxckpt.load_safetensors(str(hf / FIRST), {"a": np.zeros(4, np.uint8)})
    np.testing.assert_array_equal(single["a"], np.arange(4))


def test_the_fifo_tests_time_out_rather_than_hang(request):
    assert request.config.pluginmanager.hasplugin("timeout")


def test_a_missing_path_is_a_jaxckpt_error(tmp_path):
    """A path with nothing there: a NoCheckpointError (a JaxckptError), not a bare
    FileNotFoundError, for a file and a directory alike."""
    target = {"w": np.zeros(2, np.float32)}
    for missing in (tmp_path / "model.safetensors", tmp_path / "model"):
        with pytest.raises(errors.NoCheckpointError, match="does not exist: no safetensors"):
            jaxckpt.load_safetensors(missing, target)
