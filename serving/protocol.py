"""Open Inference Protocol (KServe v2) tensors <-> numpy, with the checks a server owes its callers.

The wire format in one place: JSON tensors, the *binary tensor data* extension (a JSON header of
``Inference-Header-Content-Length`` bytes, then each binary tensor's raw bytes in order; raw binary
requests with a header length of 0) and gzip/deflate bodies. Every problem with a request raises
:class:`RequestError`, which the server answers with HTTP 400 (or the status it carries) and
``{"error": message}``.
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

# v2 datatype -> numpy dtype (BYTES travel as str / object arrays).
DATATYPES: dict[str, Any] = {
    "BOOL": np.bool_, "UINT8": np.uint8, "UINT16": np.uint16, "UINT32": np.uint32, "UINT64": np.uint64,
    "INT8": np.int8, "INT16": np.int16, "INT32": np.int32, "INT64": np.int64,
    "FP16": np.float16, "FP32": np.float32, "FP64": np.float64, "BYTES": np.object_,
}
ONNX_TYPES = {"tensor(float)": "FP32", "tensor(double)": "FP64", "tensor(float16)": "FP16",
              "tensor(int64)": "INT64", "tensor(int32)": "INT32", "tensor(int8)": "INT8",
              "tensor(uint8)": "UINT8", "tensor(bool)": "BOOL", "tensor(string)": "BYTES"}
MAX_ELEMENTS = 1 << 24  # per tensor; the body limit usually bites first
HEADER_LENGTH = "Inference-Header-Content-Length"  # bytes of JSON before the binary tensor data
ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}  # Content-Encoding -> zlib wbits
# Smaller responses go uncompressed even when the client accepts gzip (as aiohttp and requests do
# by default): the saving would not pay for the work.
COMPRESS_MIN_BYTES = 1024


class RequestError(ValueError):
    def __init__(self, message: str, status: int = 400, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.headers = headers or {}


@dataclass(frozen=True)
class TensorSpec:
    """A declared input or output: ``shape`` uses -1 for any size. An ``optional`` input may be
    left out of a request (Triton's model configuration has the same flag)."""

    name: str
    datatype: str
    shape: tuple[int, ...]
    optional: bool = False

    def as_json(self) -> dict:
        out = {"name": self.name, "datatype": self.datatype, "shape": list(self.shape)}
        return {**out, "optional": True} if self.optional else out


MAX_DIMS = 16  # dimensions of one tensor (every served input has at most 4)


def _flatten(name: str, data: Any, depth: int) -> list:
    """The values of nested lists in row-major order, without recursion: lists may nest ``depth``
    levels at most (the shape's rank), so no body can exhaust the stack."""
    if not isinstance(data, list):
        return [data]
    out, stack = [], [iter(data)]
    while stack:
        for item in stack[-1]:
            if isinstance(item, list):
                if len(stack) >= depth:
                    raise RequestError(f"input '{name}': 'data' is nested deeper than its shape's "
                                       f"{depth} dimension(s)")
                stack.append(iter(item))
                break
            out.append(item)
        else:
            stack.pop()
    return out


def _check_values(name: str, datatype: str, flat: list) -> None:
    if datatype == "BYTES":
        if not all(isinstance(v, str) for v in flat):
            raise RequestError(f"input '{name}': BYTES data must be strings")
    elif datatype == "BOOL":
        if not all(isinstance(v, bool) for v in flat):
            raise RequestError(f"input '{name}': BOOL data must be true/false")
    elif datatype.startswith(("INT", "UINT")):
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in flat):
            raise RequestError(f"input '{name}': {datatype} data must be integers")
        info = np.iinfo(DATATYPES[datatype])
        if flat and (min(flat) < info.min or max(flat) > info.max):
            raise RequestError(f"input '{name}': a value is out of range for {datatype}")
    elif not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat):
        raise RequestError(f"input '{name}': {datatype} data must be numbers")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _parameters(tensor: dict, what: str) -> dict:
    params = tensor.get("parameters")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise RequestError(f"{what}: 'parameters' must be an object")
    if "shared_memory_region" in params:  # the shared-memory extensions are not declared in GET /v2
        raise RequestError(f"{what}: shared memory (parameters.shared_memory_region) is not supported by "
                           "this server; send the data in the body")
    return params


_JSON_KINDS = {dict: "an object", list: "a list", str: "a string", bool: "true/false", int: "an integer",
               float: "a number", type(None): "null"}


def _kind(value: Any) -> str:
    return _JSON_KINDS.get(type(value), type(value).__name__)


def _field(value: Any, what: str, types: tuple, wanted: str, optional: bool = True) -> None:
    """400 naming ``what`` when ``value`` is not of ``types`` (bool is never an integer here)."""
    if value is None and optional:
        return
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        raise RequestError(f"{what} must be {wanted}, got {_kind(value)}")


def check_fields(body: Any) -> None:
    """The JSON type of every field of an inference request (the REST JSON, or the binary
    extension's JSON header), checked before any is used: a wrong type anywhere is a 400 naming
    the field, never an exception deeper in. Values are checked later, by :func:`parse_request`."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object with 'inputs', got {_kind(body)}")
    _field(body.get("id"), "'id'", (str,), "a string")
    _field(body.get("parameters"), "'parameters'", (dict,), "an object")
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs:
        raise RequestError(f"'inputs' must be a non-empty list of input objects, got {_kind(inputs)}"
                           + (" (empty)" if isinstance(inputs, list) else ""))
    for i, tensor in enumerate(inputs):
        if not isinstance(tensor, dict):
            raise RequestError(f"each input must be an object with name, shape, datatype and data; inputs[{i}] is "
                               f"{_kind(tensor)}")
        name = tensor.get("name")
        if not isinstance(name, str) or not name:
            raise RequestError(f"inputs[{i}] has no 'name' (a non-empty string; got {_kind(name)})")
        what = f"input {_show(name)}"
        _field(tensor.get("shape"), f"{what}: 'shape'", (list,), "a list of non-negative integers", optional=False)
        _field(tensor.get("datatype"), f"{what}: 'datatype'", (str,), f"a string, one of {', '.join(DATATYPES)}",
               optional=False)
        _field(tensor.get("parameters"), f"{what}: 'parameters'", (dict,), "an object")
        if isinstance(tensor.get("data"), dict):
            raise RequestError(f"{what}: 'data' must be a list of values, got an object")
    outputs = body.get("outputs")
    _field(outputs, "'outputs'", (list,), "a list of objects with a 'name'")
    for i, tensor in enumerate(outputs or []):
        if not isinstance(tensor, dict) or not isinstance(tensor.get("name"), str):
            raise RequestError(f"'outputs' must be a list of objects with a 'name'; outputs[{i}] is "
                               + (_kind(tensor) if not isinstance(tensor, dict) else
                                  f"an object whose 'name' is {_kind(tensor.get('name'))}"))
        _field(tensor.get("parameters"), f"output {_show(tensor['name'])}: 'parameters'", (dict,), "an object")


def decode_input(tensor: Any, binary: dict[str, bytes] | None = None) -> tuple[str, np.ndarray, str]:
    """One request input -> (name, array, datatype): its values from ``data`` (JSON) or, with
    ``parameters.binary_data_size``, from its bytes in ``binary`` (as :func:`read_request` split
    them). Both paths run the same checks."""
    if not isinstance(tensor, dict):
        raise RequestError("each input must be an object with name, shape, datatype and data")
    name, shape, datatype = tensor.get("name"), tensor.get("shape"), tensor.get("datatype")
    if not isinstance(name, str) or not name:
        raise RequestError("an input has no 'name'")
    if not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape):
        raise RequestError(f"input '{name}': 'shape' must be a list of non-negative integers")
    # The sizes besides any 0 too, not only their product: [0, 2**63, 5] has no elements, but numpy
    # has no array of that shape.
    if len(shape) > MAX_DIMS or math.prod(max(d, 1) for d in shape) > MAX_ELEMENTS:
        raise RequestError(f"input '{name}': shape {_show(shape)} is beyond this server's limits "
                           f"({MAX_DIMS} dimensions, {MAX_ELEMENTS} elements)", status=413)
    if not isinstance(datatype, str) or datatype not in DATATYPES:
        raise RequestError(f"input '{name}': unknown datatype {datatype!r}; one of {', '.join(DATATYPES)}")
    is_binary = "binary_data_size" in _parameters(tensor, f"input '{name}'")
    if is_binary and "data" in tensor:
        raise RequestError(f"input '{name}': give either 'data' or parameters.binary_data_size, not both")
    if not is_binary and "data" not in tensor:
        raise RequestError(f"input '{name}': no 'data' (nor parameters.binary_data_size)")
    count = math.prod(shape)
    if is_binary:
        if binary is None or name not in binary:
            raise RequestError(f"input '{name}': parameters.binary_data_size given but no binary data follows "
                               f"the JSON (is the {HEADER_LENGTH} header set?)")
        return name, tensor_from_bytes(name, datatype, shape, binary[name]), datatype
    flat = _flatten(name, tensor["data"], max(len(shape), 1))
    if len(flat) != count:
        raise RequestError(f"input '{name}': shape {shape} needs {count} values, got {len(flat)} in 'data'")
    _check_values(name, datatype, flat)
    array = np.array(flat, dtype=DATATYPES[datatype]).reshape(shape)  # row-major, as the spec says
    _check_finite(name, datatype, array)
    return name, array, datatype


def _check_finite(name: str, datatype: str, array: np.ndarray) -> None:
    """After the cast: 1e300 is a finite JSON number but inf as FP32."""
    if datatype.startswith("FP") and not np.isfinite(array).all():
        raise RequestError(f"input '{name}': {datatype} data must be finite (and within {datatype}'s range)")


def check_against(spec: TensorSpec, array: np.ndarray, datatype: str) -> None:
    if datatype != spec.datatype:
        raise RequestError(f"input '{spec.name}' must be {spec.datatype}, got {datatype}")
    if len(array.shape) != len(spec.shape) or any(w not in (-1, d) for w, d in zip(spec.shape, array.shape)):
        raise RequestError(f"input '{spec.name}' must have shape {list(spec.shape)} (-1: any), "
                           f"got {list(array.shape)}")


def declared_shapes(body: Any, inputs: list[TensorSpec]) -> dict[str, tuple[int, ...]]:
    """The shapes a request declares for the model's ``inputs``, from its well-formed entries, for
    the model's limits before any data is read (:func:`parse_request` rejects the rest)."""
    names, shapes = {s.name for s in inputs}, {}
    tensors = body.get("inputs") if isinstance(body, dict) else None
    for tensor in tensors if isinstance(tensors, list) else []:
        if not isinstance(tensor, dict):
            continue
        name, shape = tensor.get("name"), tensor.get("shape")
        if (isinstance(name, str) and isinstance(shape, list) and len(shape) <= MAX_DIMS
                and all(_is_int(d) and 0 <= d <= MAX_ELEMENTS for d in shape)):
            shapes[name] = tuple(shape)
    return {n: s for n, s in shapes.items() if n in names}


def parse_request(body: Any, inputs: list[TensorSpec], outputs: list[TensorSpec],
                  binary: dict[str, bytes] | None = None) -> tuple[dict[str, np.ndarray], list[str], dict]:
    """Validate an inference request against a model's declared tensors. ``binary``: the binary
    inputs' bytes by name, from :func:`read_request`.

    Returns (named input arrays, requested output names in order, request parameters).
    """
    check_fields(body)
    raw = body["inputs"]
    params = body.get("parameters") or {}
    if not isinstance(params.get("binary_data_output", False), bool):
        raise RequestError("parameters.binary_data_output must be true or false")
    declared = {s.name: s for s in inputs}
    feeds = {}
    for tensor in raw:
        name, array, datatype = decode_input(tensor, binary)
        if name not in declared:
            raise RequestError(f"unknown input '{name}'; this model takes {sorted(declared)}")
        if name in feeds:
            raise RequestError(f"input '{name}' given twice")
        check_against(declared[name], array, datatype)
        feeds[name] = array
    missing = sorted(n for n, spec in declared.items() if n not in feeds and not spec.optional)
    if missing:
        raise RequestError(f"missing input(s) {missing}")
    names = [s.name for s in outputs]
    requested = body.get("outputs")
    if requested is None:
        return feeds, names, params
    if not isinstance(requested, list) or not all(isinstance(o, dict) and isinstance(o.get("name"), str)
                                                  for o in requested):
        raise RequestError("'outputs' must be a list of objects with a 'name'")
    wanted = [o["name"] for o in requested]
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise RequestError(f"unknown output(s) {unknown}; this model returns {names}")
    for o in requested:
        what = f"output '{o['name']}'"
        out_params = _parameters(o, what)
        if not isinstance(out_params.get("binary_data", False), bool):
            raise RequestError(f"{what}: parameters.binary_data must be true or false")
        if "classification" in out_params:
            raise RequestError(f"{what}: classification (parameters.classification) is not supported by this server")
    return feeds, wanted, params


def binary_outputs(body: dict, wanted: list[str]) -> set[str]:
    """The outputs to answer as binary data: per output ``parameters.binary_data``, else the
    request's ``parameters.binary_data_output`` (default false: JSON). ``body`` as checked by
    :func:`parse_request`."""
    default = (body.get("parameters") or {}).get("binary_data_output") is True
    per_output = {o["name"]: (o.get("parameters") or {}).get("binary_data") for o in body.get("outputs") or []}
    return {n for n in wanted if per_output.get(n) is True or (per_output.get(n) is None and default)}


def encode_output(name: str, array: np.ndarray, datatype: str) -> dict:
    """numpy -> ``{"name", "datatype", "shape", "data"}`` with flat row-major data."""
    array = np.asarray(array)
    if datatype == "BYTES":
        data = [v.decode() if isinstance(v, bytes) else str(v) for v in array.reshape(-1).tolist()]
    else:  # a flat numpy array: orjson writes it without a Python list in between
        data = np.ascontiguousarray(array.astype(DATATYPES[datatype], copy=False).reshape(-1))
        if datatype == "FP16":
            data = data.astype(np.float32)  # orjson has no float16
    return {"name": name, "datatype": datatype, "shape": list(array.shape), "data": data}


# ---- binary tensor data extension ----------------------------------------------------------------
def _show(value: Any, width: int = 40) -> str:
    """A client's value, quoted and cut short, for an error message."""
    text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def tensor_from_bytes(name: str, datatype: str, shape: list[int], data: bytes) -> np.ndarray:
    """An input's binary data -> array of ``shape``, checked as JSON data is.

    As the extension lays tensors out: little-endian, row-major, no padding; BOOL one byte (0 or 1);
    BYTES elements each a 4-byte little-endian length and then the bytes (UTF-8 text here: every
    served BYTES input is text).
    """
    count = math.prod(shape)
    if datatype == "BYTES":
        strings, offset, size = [], 0, len(data)
        while offset < size:
            if offset + 4 > size:
                raise RequestError(f"input '{name}': BYTES element {len(strings)} is truncated: "
                                   f"{size - offset} byte(s) left where its 4-byte length should be")
            length = int.from_bytes(data[offset : offset + 4], "little")
            offset += 4
            if offset + length > size:
                raise RequestError(f"input '{name}': BYTES element {len(strings)} is truncated: its length says "
                                   f"{length} bytes but {size - offset} remain")
            try:
                strings.append(bytes(data[offset : offset + length]).decode())
            except UnicodeDecodeError:
                raise RequestError(f"input '{name}': BYTES element {len(strings)} is not UTF-8 text") from None
            offset += length
        if len(strings) != count:
            raise RequestError(f"input '{name}': shape {shape} needs {count} values, got {len(strings)}")
        return np.array(strings, dtype=np.object_).reshape(shape)
    wire = np.dtype(DATATYPES[datatype]).newbyteorder("<")
    if len(data) != count * wire.itemsize:
        raise RequestError(f"input '{name}': shape {shape} of {datatype} takes {count * wire.itemsize} bytes "
                           f"({count} x {wire.itemsize}), but its binary_data_size is {len(data)}")
    if datatype == "BOOL" and (np.frombuffer(data, np.uint8) > 1).any():
        raise RequestError(f"input '{name}': BOOL data must be bytes 0 (false) or 1 (true)")
    array = np.frombuffer(data, wire).astype(DATATYPES[datatype]).reshape(shape)  # native order, writable
    _check_finite(name, datatype, array)
    return array


def tensor_to_bytes(array: np.ndarray, datatype: str) -> bytes:
    """An array -> its binary data as the extension lays it out (see :func:`tensor_from_bytes`)."""
    array = np.asarray(array)
    if datatype == "BYTES":
        parts = []
        for value in array.reshape(-1).tolist():
            raw = value if isinstance(value, bytes) else str(value).encode()
            parts += (len(raw).to_bytes(4, "little"), raw)
        return b"".join(parts)
    return np.ascontiguousarray(array, dtype=np.dtype(DATATYPES[datatype]).newbyteorder("<")).tobytes()


def _header_length(value: str, body_size: int) -> int:
    text = value.strip()
    if not re.fullmatch(r"[0-9]{1,15}", text):
        raise RequestError(f"the {HEADER_LENGTH} header must be a non-negative integer (the length of the JSON "
                           f"in bytes), got {_show(value)}")
    size = int(text)
    if size > body_size:
        raise RequestError(f"the {HEADER_LENGTH} header says {size} bytes of JSON but the body has only "
                           f"{body_size} bytes")
    return size


def _raw_request(raw: bytes, inputs: list[TensorSpec]) -> tuple[dict, dict[str, bytes]]:
    """``Inference-Header-Content-Length: 0``: the whole body is the data of the model's one input,
    whose shape follows from the body's size. As in Triton, the request is one batch row (a leading
    -1 becomes 1), at most one other dimension may be free, a BYTES input is one element (the body
    without a length prefix), and every output is answered as binary data."""
    required = [s for s in inputs if not s.optional]
    if len(required) != 1:
        raise RequestError(f"a raw binary request ({HEADER_LENGTH}: 0) is for models with one input; this one "
                           f"takes {[s.name for s in inputs]}: send a JSON header")
    spec = required[0]
    shape = list(spec.shape)
    if shape and shape[0] == -1:
        shape[0] = 1
    free = [i for i, d in enumerate(shape) if d == -1]
    if spec.datatype == "BYTES":
        if free or math.prod(shape) != 1:
            raise RequestError(f"a raw binary request for BYTES input '{spec.name}' needs a shape of one element; "
                               f"the model declares {list(spec.shape)}: send a JSON header")
        data = len(raw).to_bytes(4, "little") + raw
    else:
        if len(free) > 1:
            raise RequestError(f"a raw binary request cannot tell the shape of input '{spec.name}' "
                               f"{list(spec.shape)} (more than one free size besides the batch): send a JSON header")
        if free:
            row = np.dtype(DATATYPES[spec.datatype]).itemsize * math.prod(d for d in shape if d != -1)
            if row == 0 or len(raw) % row:
                raise RequestError(f"a raw binary body of {len(raw)} bytes is not a whole number of {row}-byte "
                                   f"slices of input '{spec.name}' {list(spec.shape)} ({spec.datatype})")
            shape[free[0]] = len(raw) // row
        data = raw
    body = {"inputs": [{"name": spec.name, "shape": shape, "datatype": spec.datatype,
                        "parameters": {"binary_data_size": len(data)}}],
            "parameters": {"binary_data_output": True}}
    return body, {spec.name: data}


def read_request(raw: bytes, header_length: str | None, inputs: list[TensorSpec] | None = None
                 ) -> tuple[Any, dict[str, bytes]]:
    """A request body -> (its JSON, {input name: its binary data}) for :func:`parse_request`.

    ``header_length``: the ``Inference-Header-Content-Length`` header. Without it the body is JSON
    only. With it the first ``header_length`` bytes are the JSON, and the binary data of the inputs
    that carry ``parameters.binary_data_size`` follow one after another, in the order of the inputs
    in the JSON, adding up to the rest of the body exactly. ``0``: a raw binary request for the model
    whose declared ``inputs`` are given (see :func:`_raw_request`).
    """
    import orjson  # not at the top: this module is also bundled into Triton's python backend

    size = len(raw) if header_length is None else _header_length(header_length, len(raw))
    if header_length is not None and size == 0:
        return _raw_request(raw, list(inputs or []))
    try:
        body = orjson.loads(memoryview(raw)[:size])
    except orjson.JSONDecodeError as err:
        if header_length is not None:
            raise RequestError(f"invalid request: the JSON header (the first {size} bytes of the body, as "
                               f"{HEADER_LENGTH} says) is not valid JSON ({err})") from None
        hint = f"; binary tensor data needs the {HEADER_LENGTH} header" if b'"binary_data_size"' in raw else ""
        raise RequestError(f"invalid request: the body is not valid JSON ({err}){hint}") from None
    check_fields(body)
    sizes: list[tuple[str, int]] = []
    for tensor in body["inputs"]:
        params = tensor.get("parameters") or {}
        if "binary_data_size" not in params:
            continue
        name, n = tensor["name"], params["binary_data_size"]
        if not _is_int(n) or n < 0:
            raise RequestError(f"input '{name}': parameters.binary_data_size must be a non-negative integer, "
                               f"got {_show(n)}")
        sizes.append((name, n))
    declared, available = sum(n for _, n in sizes), len(raw) - size
    if declared != available:
        if header_length is None:
            name = next(name for name, n in sizes if n)
            raise RequestError(f"input '{name}' has parameters.binary_data_size but the request has no "
                               f"{HEADER_LENGTH} header to say where the JSON ends")
        raise RequestError(f"the inputs' binary_data_size add up to {declared} bytes but {available} bytes follow "
                           f"the {size}-byte JSON header")
    binary: dict[str, bytes] = {}
    offset = size
    for name, n in sizes:
        if name in binary:
            raise RequestError(f"input '{name}' given twice")
        binary[name], offset = raw[offset : offset + n], offset + n
    return body, binary


MAX_MEMBERS = 64  # gzip members of one body (a client compresses once; concatenations are rare)
INFLATE_CHUNK = 1 << 16  # compressed bytes fed at a time: the work per member is what it consumes


def decode_body(raw: bytes, content_encoding: str | None, limit: int, check=None) -> bytes:
    """Undo a gzip or deflate ``Content-Encoding`` (tritonclient's request_compression_algorithm);
    the body it decompresses to may be ``limit`` bytes at most (HTTP 413 beyond), in at most
    :data:`MAX_MEMBERS` gzip members (400 beyond). Linear in the body's size: the input is fed in
    chunks of a view, never copied per member. ``check``: called between chunks (the request's
    deadline: it raises to stop)."""
    codings = [c.strip().lower() for c in (content_encoding or "").split(",")]
    codings = [c for c in codings if c and c != "identity"]
    if not codings:
        return raw
    coding = codings[0]
    if len(codings) > 1 or coding not in ENCODINGS:
        raise RequestError(f"Content-Encoding {_show(content_encoding)} is not supported; send the body as it "
                           "is or compressed with gzip or deflate", headers={"Accept-Encoding": "gzip, deflate"})
    view, at, parts, total, members = memoryview(raw), 0, [], 0, 0
    while True:  # gzip: one member after another
        members += 1
        if members > MAX_MEMBERS:
            raise RequestError(f"the gzip body has more than {MAX_MEMBERS} members; compress the body as one")
        stream = zlib.decompressobj(ENCODINGS[coding])
        while not stream.eof and at < len(view):
            if check is not None:
                check()
            chunk = view[at : at + INFLATE_CHUNK]
            try:
                parts.append(stream.decompress(chunk, limit + 1 - total))
            except zlib.error as err:
                raise RequestError(f"the body is not valid {coding} data ({err})") from None
            total += len(parts[-1])
            if total > limit:
                raise RequestError(f"request body larger than {limit} bytes once decompressed", status=413)
            # below the output cap every byte is consumed, but those after the member's end
            at += len(chunk) - len(stream.unused_data)
        if not stream.eof:
            raise RequestError(f"the {coding} body is truncated")
        if at == len(view):
            return b"".join(parts)
        if coding != "gzip":
            raise RequestError(f"the {coding} body has {len(view) - at} bytes after the end of its data")


def accepted_encoding(accept_encoding: str | None) -> str | None:
    """gzip or deflate when ``Accept-Encoding`` takes one (the higher q; the first on a tie), else None."""
    best, best_q = None, 0.0
    for item in (accept_encoding or "").split(","):
        coding, _, rest = item.partition(";")
        coding = coding.strip().lower()
        if coding not in ENCODINGS:
            continue
        match = re.search(r"q\s*=\s*([0-9.]+)", rest)
        try:
            q = float(match.group(1)) if match else 1.0
        except ValueError:
            q = 0.0
        if q > best_q:
            best, best_q = coding, q
    return best


def encode_response(header: dict, outputs: list[tuple[str, np.ndarray, str]],
                    binary: set[str] | frozenset = frozenset(), accept_encoding: str | None = None
                    ) -> tuple[bytes, dict[str, str]]:
    """A response -> (body, HTTP headers). ``header``: model_name, model_version, id...;
    ``outputs``: (name, array, datatype) in order; ``binary``: the outputs to send as binary data.

    No binary output: the JSON response (application/json). Otherwise the JSON, whose binary
    outputs carry ``parameters.binary_data_size`` instead of ``data``, then their bytes in order
    (application/octet-stream, ``Inference-Header-Content-Length``: the JSON's length). Compressed
    when ``Accept-Encoding`` takes gzip or deflate and the body has ``COMPRESS_MIN_BYTES`` or more:
    fast (level 1), since it runs on the event loop.
    """
    import orjson  # not at the top: this module is also bundled into Triton's python backend

    tensors, chunks = [], []
    for name, array, datatype in outputs:
        if name in binary:
            data = tensor_to_bytes(array, datatype)
            tensors.append({"name": name, "datatype": datatype, "shape": list(np.shape(array)),
                            "parameters": {"binary_data_size": len(data)}})
            chunks.append(data)
        else:
            tensors.append(encode_output(name, array, datatype))
    text = orjson.dumps({**header, "outputs": tensors}, option=orjson.OPT_SERIALIZE_NUMPY)
    if any(name in binary for name, _, _ in outputs):
        body = b"".join([text, *chunks])
        headers = {"Content-Type": "application/octet-stream", HEADER_LENGTH: str(len(text))}
    else:
        body, headers = text, {"Content-Type": "application/json"}
    coding = accepted_encoding(accept_encoding) if len(body) >= COMPRESS_MIN_BYTES else None
    if coding is not None:
        packer = zlib.compressobj(1, zlib.DEFLATED, ENCODINGS[coding])
        body = packer.compress(body) + packer.flush()
        headers["Content-Encoding"] = coding
    return body, headers
