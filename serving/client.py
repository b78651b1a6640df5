"""A small Open Inference Protocol client (standard library only); `attnzoo predict` is serving/predict.py.

    from serving.client import Client
    c = Client("http://127.0.0.1:8000")
    c.translate("bahdanau", ["Wo ist der Bahnhof?"])[0]["translation"]
    c.infer("ntm", {"x": x})["bits"]
"""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from serving.protocol import DATATYPES, HEADER_LENGTH, tensor_from_bytes, tensor_to_bytes

NUMPY_TO_V2 = {np.dtype(v).str: k for k, v in DATATYPES.items() if k != "BYTES"}


class ServerError(RuntimeError):
    def __init__(self, status: int, message: str):
        super().__init__(f"HTTP {status}: {message}")
        self.status = status


class LocalError(ServerError):
    """What the server would answer with HTTP ``status``, raised in process (no HTTP involved)."""

    def __init__(self, status: int, message: str):
        RuntimeError.__init__(self, message)
        self.status = status


class Client:
    def __init__(self, url: str = "http://127.0.0.1:8000", timeout: float = 60.0):
        self.url, self.timeout = url.rstrip("/"), timeout

    def call(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        return json.loads(self.send(method, path, data, {"Content-Type": "application/json"})[0])

    def send(self, method: str, path: str, data: bytes | None, headers: dict[str, str]) -> tuple[bytes, Any]:
        """One HTTP exchange -> (response body, response headers); errors as :class:`ServerError`."""
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                return resp.read(), resp.headers
        except urllib.error.HTTPError as err:
            text = err.read().decode(errors="replace")
            try:
                message = json.loads(text).get("error", text)
            except (ValueError, AttributeError):
                message = text
            raise ServerError(err.code, message) from None
        except urllib.error.URLError as err:
            raise ServerError(0, f"cannot reach {self.url} ({err.reason}); is `attnzoo serve` running?") from None

    def _model(self, name: str, version: str | int | None) -> str:
        return f"/v2/models/{name}" + (f"/versions/{version}" if version is not None else "")

    def server_metadata(self) -> dict:
        return self.call("GET", "/v2")

    def ready(self) -> bool:
        try:
            return bool(self.call("GET", "/v2/health/ready")["ready"])
        except ServerError:
            return False

    def wait_ready(self, timeout_s: float = 30.0, alive=lambda: True) -> bool:
        """Poll readiness until ready (True), ``timeout_s`` passes or ``alive()`` turns false."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and alive():
            if self.ready():
                return True
            time.sleep(0.1)
        return False

    def model_metadata(self, name: str, version: str | int | None = None) -> dict:
        return self.call("GET", self._model(name, version))

    def infer(self, name: str, inputs: dict[str, Any], version: str | int | None = None,
              outputs: list[str] | None = None, parameters: dict | None = None,
              request_id: str | None = None, binary: bool = False) -> dict[str, np.ndarray]:
        """Named arrays (or lists of str for BYTES) in, named numpy arrays out. ``binary``: send
        the inputs and get the outputs as binary tensor data, not JSON (no text round trip)."""
        tensors = {n: as_tensor(v) for n, v in inputs.items()}
        blobs = {n: tensor_to_bytes(*t) for n, t in tensors.items()} if binary else {}
        body: dict[str, Any] = {"inputs": [encode(n, *t, len(blobs[n]) if binary else None)
                                           for n, t in tensors.items()]}
        if outputs:
            body["outputs"] = [{"name": n} for n in outputs]
        if parameters or binary:
            body["parameters"] = {**(parameters or {}), **({"binary_data_output": True} if binary else {})}
        if request_id is not None:
            body["id"] = request_id
        path = self._model(name, version) + "/infer"
        if not binary:
            return {o["name"]: decode(o) for o in self.call("POST", path, body)["outputs"]}
        header = json.dumps(body).encode()
        data = b"".join([header, *blobs.values()])
        raw, headers = self.send("POST", path, data, {"Content-Type": "application/octet-stream",
                                                      HEADER_LENGTH: str(len(header))})
        size = int(headers.get(HEADER_LENGTH) or len(raw))
        resp, offset, out = json.loads(raw[:size]), size, {}
        for o in resp["outputs"]:
            n = (o.get("parameters") or {}).get("binary_data_size")
            if n is None:
                out[o["name"]] = decode(o)
                continue
            chunk, offset = raw[offset : offset + n], offset + n
            if o["datatype"] == "BYTES":
                out[o["name"]] = tensor_from_bytes(o["name"], "BYTES", o["shape"], chunk)
            else:
                wire = np.dtype(DATATYPES[o["datatype"]]).newbyteorder("<")
                out[o["name"]] = np.frombuffer(chunk, wire).astype(DATATYPES[o["datatype"]]).reshape(o["shape"])
        return out

    def translate(self, name: str, texts: list[str], decode_mode: str = "beam",
                  version: str | int | None = None, nbest: int = 1) -> list[dict]:
        """Each text -> translation, pieces, attention and ``nbest``: [(hypothesis, score)], best first."""
        params = {"decode": decode_mode, **({"nbest": nbest} if nbest != 1 else {})}
        out = self.infer(name, {"text": list(texts)}, version, parameters=params)
        results = []
        for i, text in enumerate(out["translation"]):
            tgt = [p for p in out["target_pieces"][i] if p]
            src = [p for p in out["source_pieces"][i] if p]
            ranked = [(str(h), float(sc)) for h, sc in zip(out["nbest"][i], out["nbest_scores"][i]) if h or sc == sc]
            results.append({"translation": str(text), "source_pieces": src, "target_pieces": tgt,
                            "attention": out["attention"][i, : len(tgt), : len(src)], "nbest": ranked})
        return results


class LocalClient(Client):
    """The same calls as :class:`Client`, answered in this process from a model repository folder
    (``attnzoo predict --local``): the published ONNX graphs and the server's own decoding loops,
    request checks and limits, with no server. Loads a model's versions on first use."""

    def __init__(self, root: Path | str = "model_repository", provider: str = "cpu", threads: int = 0):
        self.root, self.provider, self.threads = Path(root), provider, threads
        self.loaded: dict[tuple[str, int], Any] = {}

    def _versions(self, name: str) -> dict[int, dict]:
        from serving.repository import NAME_RE
        from serving.version import versions_in

        folder = self.root / name
        if not NAME_RE.match(name) or not folder.is_dir():
            known = sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []
            where = f"; {self.root} holds: {', '.join(known)}" if known else \
                f"; {self.root} holds no models (run `dvc repro` to publish, or pass --repository DIR)"
            raise LocalError(404, f"unknown model '{name}'{where}")
        return {v: json.loads((folder / str(v) / "metadata.json").read_text())
                for v in versions_in(folder) if (folder / str(v) / "metadata.json").exists()}

    def _load(self, name: str, version: str | int | None):
        from serving.kinds import load_version
        from serving.repository import default_version
        from serving.version import VERSION_RE

        metas = self._versions(name)
        if not metas:
            raise LocalError(404, f"model '{name}' has no published version in {self.root / name}")
        if version is None:
            chosen, why = default_version(metas)
            if chosen is None:
                raise LocalError(409, f"model '{name}': {why.format(name=name, version=max(metas))}")
        elif VERSION_RE.match(str(version)) and int(version) in metas:
            chosen = int(version)
        else:
            raise LocalError(404, f"model '{name}' has no version '{version}'; versions: {sorted(metas)}")
        key = (name, chosen)
        if key not in self.loaded:
            whole, _, _ = load_version(name, chosen, self.root / name / str(chosen), self.provider, self.threads)
            if whole is None:
                raise LocalError(404, f"model '{name}' version {chosen} has no serving loop in its metadata "
                                       "(published before serving existed): re-run publish")
            self.loaded[key] = (whole, sorted(metas))
        return self.loaded[key]

    def model_metadata(self, name: str, version: str | int | None = None) -> dict:
        model, versions = self._load(name, version)
        return model.metadata(versions)

    def infer(self, name: str, inputs: dict[str, Any], version: str | int | None = None,
              outputs: list[str] | None = None, parameters: dict | None = None,
              request_id: str | None = None, binary: bool = False) -> dict[str, np.ndarray]:
        from serving.protocol import RequestError, parse_request

        model, _ = self._load(name, version)
        tensors = {n: as_tensor(v) for n, v in inputs.items()}
        body: dict[str, Any] = {"inputs": [encode(n, *t) for n, t in tensors.items()]}
        if outputs:
            body["outputs"] = [{"name": n} for n in outputs]
        if parameters:
            body["parameters"] = parameters
        try:  # the server's own request checks, so a local answer is the server's answer
            feeds, wanted, params = parse_request(body, model.inputs, model.outputs)
            model.check_limits({n: a.shape for n, a in feeds.items()}, params)
            outs = model.infer(feeds, params)
        except RequestError as err:
            raise LocalError(err.status, str(err)) from None
        return {n: _as_client_array(outs[n][0]) for n in wanted}


def _as_client_array(array: np.ndarray) -> np.ndarray:
    """What :func:`decode` gives for the same tensor over HTTP: BYTES as ``str`` objects."""
    if array.dtype == object:
        flat = [v.decode() if isinstance(v, bytes) else str(v) for v in array.ravel()]
        return np.array(flat, dtype=object).reshape(array.shape)
    return array


def as_tensor(value: Any) -> tuple[np.ndarray, str]:
    """A value -> (array, v2 datatype): text is BYTES; float64 goes as FP32, which the graphs take."""
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return np.array(value, dtype=object), "BYTES"
    array = np.asarray(value)
    if array.dtype.kind in "OUS":
        return array.astype(object), "BYTES"
    if array.dtype == np.float64:
        array = array.astype(np.float32)
    return array, NUMPY_TO_V2[array.dtype.str]


def encode(name: str, array: np.ndarray, datatype: str, binary_size: int | None = None) -> dict:
    """An input's JSON: its data, or the size of its binary data (which follows the JSON)."""
    tensor = {"name": name, "shape": list(array.shape), "datatype": datatype}
    if binary_size is not None:
        return {**tensor, "parameters": {"binary_data_size": binary_size}}
    data = [str(v) for v in array.reshape(-1)] if datatype == "BYTES" else array.reshape(-1).tolist()
    return {**tensor, "data": data}


def decode(output: dict) -> np.ndarray:
    dtype = DATATYPES[output["datatype"]]
    return np.array(output["data"], dtype=dtype).reshape(output["shape"])
