"""The binary tensor data extension of the Open Inference Protocol (Triton's and KServe's
``binary_tensor_data``): the wire format byte for byte, every framing error as a 400, and NVIDIA's
own client (``tritonclient.http``, binary by default) against the real server on every model kind."""

from __future__ import annotations

import gzip
import json
import struct
import urllib.error
import urllib.request
import zlib
from email.message import Message

import numpy as np
import orjson
import pytest
import tritonclient.http as httpclient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tritonclient.utils import InferenceServerException, np_to_triton_dtype

from serving.protocol import (
    COMPRESS_MIN_BYTES,
    DATATYPES,
    HEADER_LENGTH,
    RequestError,
    TensorSpec,
    accepted_encoding,
    binary_outputs,
    decode_body,
    encode_output,
    encode_response,
    parse_request,
    read_request,
    tensor_from_bytes,
    tensor_to_bytes,
)
from tests.conftest import ROOT, tiny_batch
from tests.test_serving import TEXTS, server  # noqa: F401  (module-scoped fixtures: a server of our own)


def frame(header: dict, *chunks: bytes) -> tuple[bytes, str]:
    """A request as the extension lays it out: (body, Inference-Header-Content-Length)."""
    text = json.dumps(header).encode()
    return text + b"".join(chunks), str(len(text))


def binary_input(name: str, datatype: str, shape: list[int], size: int) -> dict:
    return {"name": name, "datatype": datatype, "shape": shape, "parameters": {"binary_data_size": size}}


# ---- the wire format, byte for byte -------------------------------------------------------------
def test_the_specs_example_request_and_response():
    """docs/protocol/extension_binary_data.md: two binary inputs (16 + 3 bytes), one binary output."""
    header = {"model_name": "mymodel",
              "inputs": [binary_input("input0", "UINT32", [2, 2], 16), binary_input("input1", "BOOL", [3], 3)],
              "outputs": [{"name": "output0", "parameters": {"binary_data": True}}]}
    raw, length = frame(header, struct.pack("<4I", 1, 2, 3, 2**32 - 1), b"\x01\x00\x01")
    body, binary = read_request(raw, length)
    assert body == header and binary == {"input0": struct.pack("<4I", 1, 2, 3, 2**32 - 1), "input1": b"\x01\x00\x01"}
    specs = [TensorSpec("input0", "UINT32", (2, 2)), TensorSpec("input1", "BOOL", (3,))]
    feeds, wanted, params = parse_request(body, specs, [TensorSpec("output0", "FP32", (-1, 2))], binary)
    assert feeds["input0"].dtype == np.uint32 and feeds["input0"].tolist() == [[1, 2], [3, 2**32 - 1]]
    assert feeds["input1"].dtype == np.bool_ and feeds["input1"].tolist() == [True, False, True]
    assert wanted == ["output0"] and params == {} and binary_outputs(body, wanted) == {"output0"}

    out = np.arange(6, dtype=np.float32).reshape(3, 2)
    content, headers = encode_response({"model_name": "mymodel", "model_version": "1"}, [("output0", out, "FP32")],
                                       {"output0"})
    n = int(headers[HEADER_LENGTH])
    assert headers["Content-Type"] == "application/octet-stream" and len(content) == n + 24
    assert json.loads(content[:n]) == {"model_name": "mymodel", "model_version": "1", "outputs": [
        {"name": "output0", "datatype": "FP32", "shape": [3, 2], "parameters": {"binary_data_size": 24}}]}
    assert content[n:] == struct.pack("<6f", 0, 1, 2, 3, 4, 5)


ROUND_TRIP = [  # datatype, values, their bytes on the wire (little-endian, packed)
    ("BOOL", [True, False, True], b"\x01\x00\x01"),
    ("UINT8", [0, 255], b"\x00\xff"),
    ("UINT16", [1, 65535], b"\x01\x00\xff\xff"),
    ("UINT32", [1, 2**32 - 1], struct.pack("<2I", 1, 2**32 - 1)),
    ("UINT64", [1, 2**64 - 1], struct.pack("<2Q", 1, 2**64 - 1)),
    ("INT8", [-128, 127], b"\x80\x7f"),
    ("INT16", [-2, 300], struct.pack("<2h", -2, 300)),
    ("INT32", [-(2**31), 7], struct.pack("<2i", -(2**31), 7)),
    ("INT64", [-1, 2**62], struct.pack("<2q", -1, 2**62)),
    ("FP16", [0.5, -65504.0], struct.pack("<2e", 0.5, -65504.0)),
    ("FP32", [1.5, -0.25], struct.pack("<2f", 1.5, -0.25)),
    ("FP64", [1e300, -2.5], struct.pack("<2d", 1e300, -2.5)),
    ("BYTES", ["", "Zoë"], b"\x00\x00\x00\x00" + b"\x04\x00\x00\x00Zo\xc3\xab"),
]


@pytest.mark.parametrize("datatype,values,wire", ROUND_TRIP, ids=[r[0] for r in ROUND_TRIP])
def test_every_datatype_round_trips_through_request_and_response(datatype, values, wire):
    assert {r[0] for r in ROUND_TRIP} == set(DATATYPES)
    array = np.array(values, dtype=DATATYPES[datatype])
    assert tensor_to_bytes(array, datatype) == wire
    decoded = tensor_from_bytes("t", datatype, [len(values)], wire)
    assert decoded.dtype == array.dtype and decoded.tolist() == values and decoded.flags.writeable

    raw, length = frame({"inputs": [binary_input("t", datatype, [1, len(values)], len(wire))]}, wire)
    body, binary = read_request(raw, length)
    feeds, _, _ = parse_request(body, [TensorSpec("t", datatype, (-1, -1))], [], binary)
    assert feeds["t"].shape == (1, len(values)) and feeds["t"].tolist() == [values]

    # the answer, binary and JSON: what tritonclient reads back from either is the same array
    content, headers = encode_response({"model_name": "m", "model_version": "1"}, [("t", array, datatype)], {"t"})
    result = httpclient.InferResult.from_response_body(content, header_length=int(headers[HEADER_LENGTH]))
    got = result.as_numpy("t")
    assert [v.decode() for v in got] == values if datatype == "BYTES" else got.tolist() == values
    content, headers = encode_response({"model_name": "m", "model_version": "1"}, [("t", array, datatype)])
    assert headers == {"Content-Type": "application/json"}
    got = httpclient.InferResult.from_response_body(content).as_numpy("t")
    assert got.tolist() == values


def test_json_responses_are_as_before_when_nothing_asks_for_binary():
    outs = [("bits", np.array([[1, 0]], np.uint8), "UINT8"), ("text", np.array(["ja", "nein"], object), "BYTES"),
            ("half", np.array([0.5], np.float16), "FP16")]
    header = {"model_name": "m", "model_version": "2", "id": "7"}
    content, headers = encode_response(header, outs, set())
    assert headers == {"Content-Type": "application/json"}
    assert content == orjson.dumps({**header, "outputs": [encode_output(*o) for o in outs]},
                                   option=orjson.OPT_SERIALIZE_NUMPY)
    assert json.loads(content)["outputs"][2] == {"name": "half", "datatype": "FP16", "shape": [1], "data": [0.5]}


def test_empty_tensors_have_binary_data_size_zero():
    raw, length = frame({"inputs": [binary_input("x", "FP32", [0, 3], 0), binary_input("s", "BYTES", [0], 0)]})
    assert raw[int(length):] == b""
    body, binary = read_request(raw, length)
    feeds, _, _ = parse_request(body, [TensorSpec("x", "FP32", (-1, 3)), TensorSpec("s", "BYTES", (-1,))], [], binary)
    assert feeds["x"].shape == (0, 3) and feeds["x"].dtype == np.float32 and feeds["s"].shape == (0,)
    content, headers = encode_response({"model_name": "m", "model_version": "1"},
                                       [("x", feeds["x"], "FP32"), ("s", feeds["s"], "BYTES")], {"x", "s"})
    n = int(headers[HEADER_LENGTH])
    assert len(content) == n and [o["parameters"] for o in json.loads(content)["outputs"]] == [
        {"binary_data_size": 0}] * 2
    assert httpclient.InferResult.from_response_body(content, header_length=n).as_numpy("x").shape == (0, 3)


def test_json_and_binary_inputs_mix_in_one_request_and_outputs_choose_one_by_one():
    header = {"id": "r1", "parameters": {"binary_data_output": True, "decode": "greedy"},
              "inputs": [binary_input("ids", "INT64", [2], 16),
                         {"name": "scale", "datatype": "FP32", "shape": [1], "data": [0.5]},
                         binary_input("words", "BYTES", [1, 2], 11)],
              "outputs": [{"name": "a"}, {"name": "b", "parameters": {"binary_data": False}},
                          {"name": "c", "parameters": {"binary_data": True}}]}
    raw, length = frame(header, struct.pack("<2q", 3, -4), b"\x02\x00\x00\x00ab", b"\x01\x00\x00\x00c")
    body, binary = read_request(raw, length)
    assert binary == {"ids": struct.pack("<2q", 3, -4), "words": b"\x02\x00\x00\x00ab\x01\x00\x00\x00c"}
    specs = [TensorSpec("ids", "INT64", (-1,)), TensorSpec("scale", "FP32", (1,)), TensorSpec("words", "BYTES", (1, 2))]
    outs = [TensorSpec(n, "FP32", (-1,)) for n in "abc"]
    feeds, wanted, params = parse_request(body, specs, outs, binary)
    assert feeds["ids"].tolist() == [3, -4] and feeds["scale"].tolist() == [0.5]
    assert feeds["words"].dtype == object and feeds["words"].tolist() == [["ab", "c"]]
    assert wanted == ["a", "b", "c"] and params["decode"] == "greedy"
    assert binary_outputs(body, wanted) == {"a", "c"}  # the request's default, b's own false
    assert binary_outputs({"inputs": []}, ["a", "b"]) == set()  # JSON unless asked
    content, headers = encode_response({"model_name": "m", "model_version": "1", "id": "r1"},
                                       [(n, np.full(2, i, np.float32), "FP32") for i, n in enumerate(wanted)],
                                       {"a", "c"})
    n = int(headers[HEADER_LENGTH])
    outputs = json.loads(content[:n])["outputs"]
    assert [("data" in o, o.get("parameters")) for o in outputs] == [
        (False, {"binary_data_size": 8}), (True, None), (False, {"binary_data_size": 8})]
    assert content[n:] == struct.pack("<4f", 0, 0, 2, 2)


def test_raw_binary_request_is_the_one_input_and_answers_in_binary():
    """Inference-Header-Content-Length: 0: the body is the input's data; its shape follows from the
    size (a leading -1 is one batch row); every output comes back binary."""
    x = np.arange(10, dtype=np.float32)
    body, binary = read_request(x.tobytes(), "0", [TensorSpec("x", "FP32", (-1, -1, 5))])
    assert body == {"inputs": [binary_input("x", "FP32", [1, 2, 5], 40)], "parameters": {"binary_data_output": True}}
    feeds, wanted, _ = parse_request(body, [TensorSpec("x", "FP32", (-1, -1, 5))], [TensorSpec("y", "FP32", (-1,))],
                                     binary)
    assert np.array_equal(feeds["x"], x.reshape(1, 2, 5)) and binary_outputs(body, wanted) == {"y"}
    body, binary = read_request("Grüß".encode(), "0", [TensorSpec("text", "BYTES", (-1,))])
    assert parse_request(body, [TensorSpec("text", "BYTES", (-1,))], [], binary)[0]["text"].tolist() == ["Grüß"]
    specs = [TensorSpec("image", "FP32", (-1, 2, 2)), TensorSpec("width", "INT64", (-1,), optional=True)]
    assert read_request(bytes(16), "0", specs)[0]["inputs"][0]["shape"] == [1, 2, 2]  # optional inputs left out


# ---- every framing problem: HTTP 400 and one sentence -------------------------------------------
X = [TensorSpec("x", "FP32", (-1, 2))]
S = [TensorSpec("s", "BYTES", (-1,))]
FOUR = struct.pack("<4f", 1, 2, 3, 4)
BAD = [  # (body, Inference-Header-Content-Length, declared inputs, expected message)
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}, FOUR)[:1], "12a", X,
     "header must be a non-negative integer (the length of the JSON in bytes), got '12a'"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}, FOUR)[:1], "-5", X, "non-negative integer"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}, FOUR)[:1], "", X, "non-negative integer"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}, FOUR)[:1], "9999", X,
     "header says 9999 bytes of JSON but the body has only"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}, FOUR[:15]), X,
     "the inputs' binary_data_size add up to 16 bytes but 15 bytes follow the"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}, FOUR + b"!"), X,
     "add up to 16 bytes but 17 bytes follow"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], 12)]}, FOUR[:12]), X,
     "input 'x': shape [2, 2] of FP32 takes 16 bytes (4 x 4), but its binary_data_size is 12"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], -16)]}, FOUR), X,
     "input 'x': parameters.binary_data_size must be a non-negative integer, got -16"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], "16")]}, FOUR), X, "got '16'"),
    (*frame({"inputs": [binary_input("x", "FP32", [2, 2], True)]}, FOUR), X, "non-negative integer, got True"),
    (*frame({"inputs": [{**binary_input("x", "FP32", [1, 2], 8), "data": [1, 2]}]}, FOUR[:8]), X,
     "input 'x': give either 'data' or parameters.binary_data_size, not both"),
    (json.dumps({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}).encode() + FOUR, None, X,
     "binary tensor data needs the Inference-Header-Content-Length header"),
    (json.dumps({"inputs": [binary_input("x", "FP32", [2, 2], 16)]}).encode(), None, X,
     "input 'x' has parameters.binary_data_size but the request has no Inference-Header-Content-Length header"),
    (b"{oops" + FOUR, "5", X, "the JSON header (the first 5 bytes of the body, as Inference-Header-Content-Length"),
    (*frame({"inputs": [binary_input("x", "FP32", [1, 2], 8)]}, struct.pack("<2f", 1, float("nan"))), X,
     "input 'x': FP32 data must be finite"),
    (*frame({"inputs": [binary_input("b", "BOOL", [2], 2)]}, b"\x01\x02"), [TensorSpec("b", "BOOL", (2,))],
     "input 'b': BOOL data must be bytes 0 (false) or 1 (true)"),
    (*frame({"inputs": [binary_input("s", "BYTES", [2], 7)]}, b"\x01\x00\x00\x00a\x05\x00"), S,
     "input 's': BYTES element 1 is truncated: 2 byte(s) left where its 4-byte length should be"),
    (*frame({"inputs": [binary_input("s", "BYTES", [1], 7)]}, b"\x09\x00\x00\x00abc"), S,
     "input 's': BYTES element 0 is truncated: its length says 9 bytes but 3 remain"),
    (*frame({"inputs": [binary_input("s", "BYTES", [2], 5)]}, b"\x01\x00\x00\x00a"), S,
     "input 's': shape [2] needs 2 values, got 1"),
    (*frame({"inputs": [binary_input("s", "BYTES", [1], 5)]}, b"\x01\x00\x00\x00\xff"), S,
     "input 's': BYTES element 0 is not UTF-8 text"),
    (*frame({"inputs": [binary_input("x", "FP32", [1, 2], 8), binary_input("x", "FP32", [1, 2], 8)]}, FOUR), X,
     "input 'x' given twice"),
    (*frame({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "parameters": [8]}]}), X,
     "input 'x': 'parameters' must be an object"),
    (*frame({"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2],
                         "parameters": {"shared_memory_region": "r", "shared_memory_byte_size": 8}}]}), X,
     "input 'x': shared memory (parameters.shared_memory_region) is not supported"),
    (*frame({"inputs": [binary_input("x", "FP32", [1, 2], 8)],
             "outputs": [{"name": "y", "parameters": {"binary_data": "yes"}}]}, FOUR[:8]), X,
     "output 'y': parameters.binary_data must be true or false"),
    (*frame({"inputs": [binary_input("x", "FP32", [1, 2], 8)], "parameters": {"binary_data_output": 1}}, FOUR[:8]),
     X, "parameters.binary_data_output must be true or false"),
    (*frame({"inputs": [binary_input("x", "FP32", [1, 2], 8)],
             "outputs": [{"name": "y", "parameters": {"classification": 3}}]}, FOUR[:8]), X,
     "output 'y': classification (parameters.classification) is not supported"),
    (FOUR[:12], "0", [TensorSpec("x", "FP32", (-1, -1, 2))],
     "a raw binary body of 12 bytes is not a whole number of 8-byte slices of input 'x' [-1, -1, 2] (FP32)"),
    (FOUR[:12], "0", X, "input 'x': shape [1, 2] of FP32 takes 8 bytes (2 x 4), but its binary_data_size is 12"),
    (FOUR, "0", [TensorSpec("x", "FP32", (-1, 2)), TensorSpec("y", "FP32", (-1,))],
     "a raw binary request (Inference-Header-Content-Length: 0) is for models with one input"),
    (FOUR, "0", [TensorSpec("x", "FP32", (-1, -1, -1))], "more than one free size besides the batch"),
    (FOUR, "0", [TensorSpec("s", "BYTES", (-1, 2))], "needs a shape of one element"),
]


@pytest.mark.parametrize("raw,length,specs,message", BAD, ids=[f"{i}-{b[3][:30]}" for i, b in enumerate(BAD)])
def test_malformed_binary_requests_are_400_with_one_sentence(raw, length, specs, message):
    with pytest.raises(RequestError) as caught:
        body, binary = read_request(raw, length, specs)
        feeds, wanted, _ = parse_request(body, specs, [TensorSpec("y", "FP32", (-1,))], binary)
        binary_outputs(body, wanted)
    assert caught.value.status == 400 and message in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def _nested(depth: int, leaf) -> list:
    data = leaf
    for _ in range(depth):  # built without recursion, as a hostile client would send it
        data = [data]
    return data


HOSTILE = [  # (request input, status, message): each a client error, none an exception in numpy or Python
    ({"name": "x", "datatype": "FP32", "shape": [0, 2**63, 5], "data": []}, 413, "beyond this server's limits"),
    ({"name": "x", "datatype": "FP32", "shape": [1] * 70, "data": [1.0]}, 413, "beyond this server's limits"),
    ({"name": "x", "datatype": "FP32", "shape": [1 << 24, 2], "parameters": {"binary_data_size": 0}}, 413,
     "beyond this server's limits"),
    ({"name": "x", "datatype": "FP32", "shape": [1, 2], "data": _nested(5000, 1.0)}, 400,
     "'data' is nested deeper than its shape's 2 dimension(s)"),
    ({"name": "x", "datatype": "FP32", "shape": [1, 2], "data": [1e300, 1.0]}, 400,
     "FP32 data must be finite (and within FP32's range)"),
    ({"name": "x", "datatype": "FP16", "shape": [1, 2], "data": [70000, 1.0]}, 400, "FP16 data must be finite"),
]


@pytest.mark.parametrize("tensor,status,message", HOSTILE, ids=[h[2][:30] for h in HOSTILE])
def test_hostile_shapes_nesting_and_ranges_are_client_errors(tensor, status, message):
    specs = [TensorSpec("x", tensor["datatype"], (-1, 2))]
    with pytest.raises(RequestError) as caught:
        parse_request({"inputs": [tensor]}, specs, [], {"x": b""})
    assert caught.value.status == status and message in str(caught.value), str(caught.value)


def test_json_nested_beyond_the_parsers_limit_is_a_400():
    body = b'{"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, 2], "data": ' + b"[" * 100_000 + b"1" \
        + b"]" * 100_000 + b"}]}"
    with pytest.raises(RequestError, match="not valid JSON") as caught:
        read_request(body, None, X)
    assert caught.value.status == 400


def test_parse_request_without_the_split_binary_data_says_so():
    body = {"inputs": [binary_input("x", "FP32", [1, 2], 8)]}
    with pytest.raises(RequestError, match="no binary data follows the JSON"):
        parse_request(body, X, [])


GOOD, GOOD_LENGTH = frame({"inputs": [binary_input("x", "FP32", [1, 2], 8), binary_input("s", "BYTES", [1], 6)],
                           "outputs": [{"name": "y", "parameters": {"binary_data": True}}]},
                          FOUR[:8], b"\x02\x00\x00\x00hi")


@settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
@given(cut=st.integers(0, len(GOOD)), junk=st.binary(max_size=12), at=st.integers(0, len(GOOD)),
       length=st.one_of(st.none(), st.integers(-3, len(GOOD) + 3).map(str), st.text(max_size=4)))
def test_no_framing_damage_gets_anything_but_a_request_error(cut, junk, at, length):
    """Truncated, padded, spliced bodies and any header value: a RequestError (HTTP 4xx), nothing else."""
    raw = (GOOD[:at] + junk + GOOD[at:])[:cut] if junk else GOOD[:cut]
    try:
        body, binary = read_request(raw, length, X)
        feeds, wanted, _ = parse_request(body, X + S, [TensorSpec("y", "FP32", (-1,))], binary)
        binary_outputs(body, wanted)
    except RequestError as err:
        assert 400 <= err.status < 500 and str(err)


def test_the_undamaged_body_of_the_fuzz_test_parses():
    body, binary = read_request(GOOD, GOOD_LENGTH)
    feeds, _, _ = parse_request(body, X + S, [TensorSpec("y", "FP32", (-1,))], binary)
    assert feeds["x"].tolist() == [[1, 2]] and feeds["s"].tolist() == ["hi"]


# ---- gzip / deflate (tritonclient's request_ and response_compression_algorithm) ------------------
def test_compressed_bodies_are_decompressed_within_the_limit():
    assert decode_body(GOOD, None, 1000) == GOOD and decode_body(GOOD, "identity", 1000) == GOOD
    assert decode_body(gzip.compress(GOOD), "gzip", 1000) == GOOD
    assert decode_body(zlib.compress(GOOD), "Deflate", 1000) == GOOD
    assert decode_body(gzip.compress(GOOD[:9]) + gzip.compress(GOOD[9:]), "gzip", 1000) == GOOD  # two members
    with pytest.raises(RequestError) as caught:
        decode_body(GOOD, "br", 1000)
    assert caught.value.status == 400 and caught.value.headers == {"Accept-Encoding": "gzip, deflate"}
    assert str(caught.value) == ("Content-Encoding 'br' is not supported; send the body as it is or compressed "
                                 "with gzip or deflate")
    for body, encoding, message, status in [
        (GOOD, "gzip", "the body is not valid gzip data", 400),
        (gzip.compress(GOOD)[:-12], "gzip", "the gzip body is truncated", 400),
        (zlib.compress(GOOD) + b"x", "deflate", "the deflate body has 1 bytes after the end of its data", 400),
        (gzip.compress(bytes(5000)), "gzip", "request body larger than 1000 bytes once decompressed", 413),
        (GOOD, "gzip, deflate", "Content-Encoding 'gzip, deflate' is not supported", 400),
    ]:
        with pytest.raises(RequestError, match=message) as caught:
            decode_body(body, encoding, 1000)
        assert caught.value.status == status


def test_responses_are_compressed_when_the_client_accepts_it():
    assert accepted_encoding("gzip") == "gzip" and accepted_encoding(None) is None
    assert accepted_encoding("br, deflate;q=0.9, gzip;q=0.5") == "deflate"
    assert accepted_encoding("gzip;q=0, identity") is None and accepted_encoding("*") is None
    outs = [("y", np.arange(300, dtype=np.float32), "FP32")]  # 1200 bytes: over COMPRESS_MIN_BYTES
    plain, plain_headers = encode_response({"model_name": "m", "model_version": "1"}, outs, {"y"})
    packed, headers = encode_response({"model_name": "m", "model_version": "1"}, outs, {"y"}, "gzip")
    assert gzip.decompress(packed) == plain and headers == {**plain_headers, "Content-Encoding": "gzip"}
    packed, headers = encode_response({"model_name": "m", "model_version": "1"}, outs, set(), "deflate")
    assert json.loads(zlib.decompress(packed))["outputs"][0]["data"] == list(range(300))
    assert headers == {"Content-Type": "application/json", "Content-Encoding": "deflate"}
    small = [("y", np.arange(3, dtype=np.float32), "FP32")]  # not worth compressing: sent as it is
    assert encode_response({"model_name": "m", "model_version": "1"}, small, set(), "gzip")[1] == {
        "Content-Type": "application/json"}
    # docs/serving.md states the threshold
    assert COMPRESS_MIN_BYTES == 1024 and "responses of 1 KiB or more compressed" in " ".join(
        (ROOT / "docs" / "serving.md").read_text().split())


# ---- NVIDIA's client against the real server, every model kind -----------------------------------
def _cases() -> dict[str, tuple[dict[str, np.ndarray], dict]]:
    """(inputs, parameters) per served model: one of each kind, and graphs served as they are."""
    rng = np.random.default_rng(0)
    greedy = {"decode": "greedy"}
    ocr = tiny_batch("attention_ocr", seed=3, batch=1)
    draw = tiny_batch("draw", seed=5, batch=1)
    text = {"text": np.array(TEXTS[:2], dtype=object)}
    return {
        "bahdanau": (text, greedy), "luong": (text, greedy), "transformer": (text, greedy),
        "ntm": ({"x": rng.integers(0, 2, (2, 3, 5)).astype(np.float32)}, {}),
        "draw": ({"x": draw["x"].numpy()}, {}),
        "pointer": ({"points": rng.random((2, 5, 2)).astype(np.float32)}, greedy),
        "captioner": ({"image": tiny_batch("show_attend_tell", seed=7, batch=1)["image"].numpy()}, greedy),
        "ocr": ({"image": ocr["image"].numpy(), "width": ocr["width"].numpy().astype(np.int64)}, greedy),
        "speech": ({"audio": rng.uniform(-0.5, 0.5, (1, 2400)).astype(np.float32),
                    "samples": np.array([2400], np.int64)}, greedy),
        "ram": ({"image": tiny_batch("ram", seed=4, batch=2)["image"].numpy()}, {}),
        "programmer": ({"question": np.array(["How many rows?", "sum of price where age greater than 40"], object),
                        "columns": np.array([["price", "age", "rank"]] * 2, dtype=object),
                        "table": rng.integers(0, 100, (2, 4, 3)).astype(np.float32)}, {}),
        "act": ({"x": rng.integers(-1, 2, (3, 6)).astype(np.float32)}, {}),
        "bahdanau.encoder": ({"src": np.array([[5, 6, 2], [7, 2, 0]], np.int64), "src_len": np.array([3, 2], np.int64)},
                             {}),
        "draw.infer": ({"image": draw["image"].numpy(), "noise": draw["noise"].numpy()}, {}),
    }


CASES = _cases()


@pytest.fixture(scope="module")
def triton(server):  # noqa: F811
    client = httpclient.InferenceServerClient(url=server.url.removeprefix("http://"), network_timeout=60)
    yield client
    client.close()


def _inputs(inputs: dict[str, np.ndarray], binary: bool) -> list[httpclient.InferInput]:
    out = []
    for name, array in inputs.items():
        tensor = httpclient.InferInput(name, list(array.shape), np_to_triton_dtype(array.dtype))
        out.append(tensor.set_data_from_numpy(array, binary_data=binary))
    return out


def _plain(array: np.ndarray) -> np.ndarray:
    """tritonclient gives BYTES as bytes objects (binary) or str (JSON); compare them as str."""
    if array.dtype == object:
        return np.array([v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1)],
                        dtype=object).reshape(array.shape)
    return array


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    a, b = _plain(np.asarray(a)), _plain(np.asarray(b))
    # NaN equals NaN here: a greedy answer's nbest_scores is NaN (greedy decoding has no score)
    return a.shape == b.shape and (a.size == 0 or (a.dtype == b.dtype and np.array_equal(
        a, b, equal_nan=a.dtype.kind in "fc")))


@pytest.mark.integration
def test_server_metadata_declares_the_extension(triton, server):  # noqa: F811
    meta = triton.get_server_metadata()
    assert "binary_tensor_data" in meta["extensions"] and meta["name"] == "attnzoo"
    assert server.client.server_metadata()["extensions"] == ["binary_tensor_data", "model_repository"]


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(CASES))
def test_tritonclient_binary_and_json_and_our_client_get_identical_answers(triton, server, name):  # noqa: F811
    inputs, params = CASES[name]
    meta = triton.get_model_metadata(name)
    assert meta == server.client.model_metadata(name)
    names = [o["name"] for o in meta["outputs"]]
    # (a) tritonclient's defaults: binary inputs, and no outputs named: binary_data_output for all
    result = triton.infer(name, _inputs(inputs, True), parameters=params or None)
    response = result.get_response()
    assert [o["name"] for o in response["outputs"]] == names and response["model_name"] == name
    assert all("data" not in o and o["parameters"]["binary_data_size"] >= 0 for o in response["outputs"])
    binary = {n: result.as_numpy(n) for n in names}
    # (b) tritonclient all JSON
    result = triton.infer(name, _inputs(inputs, False), parameters=params or None,
                          outputs=[httpclient.InferRequestedOutput(n, binary_data=False) for n in names])
    assert all("data" in o and "parameters" not in o for o in result.get_response()["outputs"])
    as_json = {n: result.as_numpy(n) for n in names}
    # (c), (d) the project's client, JSON and binary
    ours = server.client.infer(name, inputs, parameters=params)
    ours_binary = server.client.infer(name, inputs, parameters=params, binary=True)
    for n in names:
        assert _same(binary[n], as_json[n]), (n, binary[n], as_json[n])
        assert _same(binary[n], ours[n]) and _same(binary[n], ours_binary[n]), n


@pytest.mark.integration
def test_one_output_binary_another_json(triton, server):  # noqa: F811
    inputs, _ = CASES["programmer"]
    full = server.client.infer("programmer", inputs)
    outputs = [httpclient.InferRequestedOutput("answer", binary_data=True),
               httpclient.InferRequestedOutput("cells", binary_data=False),
               httpclient.InferRequestedOutput("is_lookup")]  # tritonclient's default: binary
    result = triton.infer("programmer", _inputs(inputs, True), outputs=outputs)
    got = {o["name"]: o for o in result.get_response()["outputs"]}
    assert list(got) == ["answer", "cells", "is_lookup"]
    assert "data" in got["cells"] and got["answer"]["parameters"] == {"binary_data_size": 4 * 2}
    assert got["is_lookup"]["parameters"] == {"binary_data_size": 2} and "data" not in got["is_lookup"]
    for n in got:
        assert _same(result.as_numpy(n), full[n]), n


@pytest.mark.integration
def test_gzip_and_deflate_bodies_both_ways(triton, server):  # noqa: F811
    """tritonclient's request_ and response_compression_algorithm: bodies compressed both ways."""
    x = np.random.default_rng(1).integers(0, 2, (2, 40, 5)).astype(np.float32)  # answers of about 9 kB
    full = server.client.infer("ntm", {"x": x})
    for request_algorithm, response_algorithm in (("gzip", "gzip"), ("deflate", "deflate"), ("gzip", None),
                                                  (None, "deflate")):
        result = triton.infer("ntm", _inputs({"x": x}, True), request_compression_algorithm=request_algorithm,
                              response_compression_algorithm=response_algorithm)
        for n in full:
            assert _same(result.as_numpy(n), full[n]), (request_algorithm, response_algorithm, n)
    raw, length = frame({"inputs": [binary_input("x", "FP32", [2, 40, 5], x.nbytes)],
                         "outputs": [{"name": "logits", "parameters": {"binary_data": True}}, {"name": "bits"}]},
                        x.tobytes())
    for encoding, unpack in (("gzip", gzip.decompress), ("deflate", zlib.decompress)):
        status, headers, content = _post(server, "/v2/models/ntm/infer", raw,
                                         {HEADER_LENGTH: length, "Accept-Encoding": encoding})
        assert status == 200 and headers["Content-Encoding"] == encoding
        result = httpclient.InferResult.from_response_body(unpack(content), header_length=int(headers[HEADER_LENGTH]))
        assert "data" not in result.get_output("logits") and "data" in result.get_output("bits")
        assert _same(result.as_numpy("logits"), full["logits"]) and _same(result.as_numpy("bits"), full["bits"])


@pytest.mark.integration
def test_tritonclient_sees_a_clear_error_for_bad_binary_input(triton, server):  # noqa: F811
    x = np.zeros((1, 2, 6), np.float32)  # ntm takes [-1, -1, 5]
    with pytest.raises(InferenceServerException) as caught:
        triton.infer("ntm", _inputs({"x": x}, True))
    assert caught.value.status() == "400" and "must have shape [-1, -1, 5]" in caught.value.message()
    with pytest.raises(InferenceServerException, match="Content-Encoding"):
        triton.infer("ntm", _inputs({"x": x[..., :5]}, True), headers={"Content-Encoding": "br"})
    assert triton.is_server_ready()


# ---- raw HTTP: framing errors are 400s and the server carries on ---------------------------------
def _post(server, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Message, bytes]:  # noqa: F811
    """POST -> (status, response headers (names in any case), body); the binary Content-Type unless
    ``headers`` give one (urllib's default, a form, is refused)."""
    req = urllib.request.Request(server.url + path, data=body, method="POST",
                                 headers={"Content-Type": "application/octet-stream", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, resp.headers, resp.read()
    except urllib.error.HTTPError as err:
        return err.code, err.headers, err.read()


NTM_X = np.arange(10, dtype=np.float32).reshape(1, 2, 5) / 10
NTM_HEADER = {"inputs": [binary_input("x", "FP32", [1, 2, 5], 40)]}
RAW_BAD = [  # (body, headers, expected message)
    (frame(NTM_HEADER, NTM_X.tobytes())[0], {HEADER_LENGTH: "forty"}, "must be a non-negative integer"),
    (frame(NTM_HEADER, NTM_X.tobytes())[0], {HEADER_LENGTH: "100000"}, "says 100000 bytes of JSON"),
    (frame(NTM_HEADER, NTM_X.tobytes()[:-4])[0], {HEADER_LENGTH: frame(NTM_HEADER)[1]},
     "add up to 40 bytes but 36 bytes follow"),
    (frame(NTM_HEADER, NTM_X.tobytes(), b"\0" * 8)[0], {HEADER_LENGTH: frame(NTM_HEADER)[1]},
     "add up to 40 bytes but 48 bytes follow"),
    (frame({"inputs": [binary_input("x", "FP32", [1, 3, 5], 40)]}, NTM_X.tobytes())[0],
     {HEADER_LENGTH: frame({"inputs": [binary_input("x", "FP32", [1, 3, 5], 40)]})[1]},
     "takes 60 bytes (15 x 4), but its binary_data_size is 40"),
    (json.dumps(NTM_HEADER).encode() + NTM_X.tobytes(), {}, "needs the Inference-Header-Content-Length header"),
    (NTM_X.tobytes()[:12], {HEADER_LENGTH: "0"}, "not a whole number of 20-byte slices"),
    (gzip.compress(frame(NTM_HEADER, NTM_X.tobytes())[0])[:-20], {HEADER_LENGTH: frame(NTM_HEADER)[1],
                                                                  "Content-Encoding": "gzip"}, "truncated"),
    (frame(NTM_HEADER, NTM_X.tobytes())[0], {HEADER_LENGTH: frame(NTM_HEADER)[1], "Content-Encoding": "br"},
     "Content-Encoding 'br' is not supported"),
]


@pytest.mark.integration
@pytest.mark.parametrize("body,headers,message", RAW_BAD, ids=[f"{i}-{b[2][:25]}" for i, b in enumerate(RAW_BAD)])
def test_malformed_binary_bodies_over_http_are_400_and_the_server_carries_on(server, body, headers, message):  # noqa: F811
    status, got_headers, content = _post(server, "/v2/models/ntm/infer", body,
                                         {"Content-Type": "application/octet-stream", **headers})
    error = json.loads(content)
    assert status == 400 and set(error) == {"error"} and message in error["error"], (status, error)
    assert got_headers["content-type"] == "application/json"
    if "'br'" in message:
        assert got_headers["Accept-Encoding"] == "gzip, deflate"
    assert server.client.ready()


@pytest.mark.integration
def test_raw_binary_request_over_http(server):  # noqa: F811
    x = CASES["act"][0]["x"][:1]
    status, headers, content = _post(server, "/v2/models/act/infer", x.tobytes(), {HEADER_LENGTH: "0"})
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    result = httpclient.InferResult.from_response_body(content, header_length=int(headers[HEADER_LENGTH]))
    expected = server.client.infer("act", {"x": x})
    for o in result.get_response()["outputs"]:
        assert "binary_data_size" in o["parameters"] and _same(result.as_numpy(o["name"]), expected[o["name"]])
    status, headers, content = _post(server, "/v2/models/bahdanau/infer", TEXTS[0].encode(), {HEADER_LENGTH: "0"})
    assert status == 200 and headers["Content-Type"] == "application/octet-stream"
    result = httpclient.InferResult.from_response_body(content, header_length=int(headers[HEADER_LENGTH]))
    assert result.as_numpy("translation")[0].decode() == server.client.translate("bahdanau", TEXTS[:1])[0][
        "translation"]
