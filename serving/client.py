"""A small Open Inference Protocol client (standard library only) and ``attnzoo predict``.

    from serving.client import Client
    c = Client("http://127.0.0.1:8000")
    c.translate("bahdanau", ["Wo ist der Bahnhof?"])[0]["translation"]
    c.infer("ntm", {"x": x})["bits"]
"""

from __future__ import annotations

import argparse
import json
import sys
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
                  version: str | int | None = None) -> list[dict]:
        out = self.infer(name, {"text": list(texts)}, version, parameters={"decode": decode_mode})
        results = []
        for i, text in enumerate(out["translation"]):
            tgt = [p for p in out["target_pieces"][i] if p]
            src = [p for p in out["source_pieces"][i] if p]
            results.append({"translation": str(text), "source_pieces": src, "target_pieces": tgt,
                            "attention": out["attention"][i, : len(tgt), : len(src)]})
        return results


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


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Ask a running attnzoo server for a prediction.")
    ap.add_argument("model")
    ap.add_argument("input", help="text for a text model; otherwise JSON ({input name: nested list}) "
                                  "or a path to a .json file holding it")
    ap.add_argument("--url", default="http://127.0.0.1:8000")
    ap.add_argument("--version", default=None)
    ap.add_argument("--decode", choices=("beam", "greedy"), default="beam", help="text models: search")
    ap.add_argument("--attention", action="store_true", help="also print the attention weights")
    args = ap.parse_args(argv)
    client = Client(args.url)
    try:
        meta = client.model_metadata(args.model, args.version)
        if [i["datatype"] for i in meta["inputs"]] == ["BYTES"] and meta["inputs"][0]["name"] == "text":
            (res,) = client.translate(args.model, [args.input], args.decode, args.version)
            print(res["translation"])
            if args.attention:
                print_alignment(res)
            return
        names = [i["name"] for i in meta["inputs"]]
        if names == ["image", "width"] and not args.input.lstrip().startswith("{"):  # attention OCR
            image = read_text_line(args.input, meta["inputs"][0]["shape"][1])
            outs = client.infer(args.model, {"image": image[None]}, args.version, parameters={"decode": args.decode})
            print(str(outs["text"][0]))
            if args.attention:  # each letter's most attended feature column
                for letter, amap in zip(outs["letters"][0], outs["attention"][0]):
                    if letter:
                        col = int(amap.max(0).argmax())
                        print(f"{letter:>4}  peak at column {col} of {amap.shape[1]} (x ≈ {col * 4 + 2} px)")
            return
        if names == ["audio", "samples"] and not args.input.lstrip().startswith("{"):  # speech
            audio = read_wav(args.input)
            outs = client.infer(args.model, {"audio": audio[None]}, args.version, parameters={"decode": args.decode})
            print(str(outs["text"][0]))
            if args.attention:  # where in the audio each character was read
                for t, row in enumerate(outs["alignment"][0]):
                    if row.any():
                        print(f"step {t + 1}: peak at encoder step {int(row.argmax())} of {row.shape[0]}")
            return
        if names == ["image"] and not args.input.lstrip().startswith("{"):
            image = read_image(args.input, tuple(meta["inputs"][0]["shape"][1:]))
            if "caption" not in [o["name"] for o in meta["outputs"]]:  # a classifier (RAM): class, glimpse path
                outs = client.infer(args.model, {"image": image[None]}, args.version)
                print(int(outs["pred"][0]))
                if args.attention:
                    for t, (x, y) in enumerate(outs["locations"][0]):
                        print(f"glimpse {t + 1}: centre x {x:+.2f}, y {y:+.2f} (-1..1 over the image)")
                return
            outs = client.infer(args.model, {"image": image[None]}, args.version,
                                parameters={"decode": args.decode})
            print(str(outs["caption"][0]))
            if args.attention:  # each word's most attended cell of the feature grid
                for word, amap in zip(outs["words"][0], outs["attention"][0]):
                    if word:
                        r, c = divmod(int(amap.argmax()), amap.shape[1])
                        print(f"{word:>8}  peak at row {r}, column {c} of {amap.shape[0]}x{amap.shape[1]}")
            return
        try:
            text = Path(args.input).read_text() if args.input.endswith(".json") else args.input
            inputs = json.loads(text)
        except (OSError, ValueError) as err:
            raise SystemExit(f"error: INPUT must be JSON like '{{\"x\": [[...]]}}' or a .json file ({err})") from None
        if not isinstance(inputs, dict):
            raise SystemExit("error: INPUT must be a JSON object mapping input names to nested lists")
        declared = {i["name"]: i["datatype"] for i in meta["inputs"]}
        try:  # JSON has no tensor types: give each input the type the model declares
            inputs = {k: np.asarray(v, dtype=DATATYPES[declared[k]]) if k in declared else v
                      for k, v in inputs.items()}
        except (TypeError, ValueError) as err:
            raise SystemExit(f"error: INPUT does not fit the model's inputs {declared}: {err}") from None
        outs = client.infer(args.model, inputs, args.version)
        shown = outs if args.attention else {k: v for k, v in outs.items() if "weights" not in k}
        print(json.dumps({k: v.tolist() for k, v in shown.items()}))
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def read_image(path: str, shape: tuple[int, ...]) -> np.ndarray:
    """A grey-scale image file (PNG, JPEG, ... or .npy) as float32 [H,W] in [0,1] of ``shape``."""
    try:
        if path.endswith(".npy"):
            pixels = np.load(path)
        else:
            from PIL import Image

            pixels = np.asarray(Image.open(path).convert("L"))
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read the image {path} ({err})") from None
    pixels = pixels.astype(np.float32)
    pixels = pixels / 255.0 if pixels.max(initial=0) > 1 else pixels
    if pixels.shape != shape:
        raise SystemExit(f"error: the model takes {shape[0]}x{shape[1]} images; {path} is "
                         f"{'x'.join(map(str, pixels.shape))}")
    return pixels


def read_text_line(path: str, height: int) -> np.ndarray:
    """A text-line image file as float32 [height, W] in [0,1], scaled to the model's height."""
    try:
        from PIL import Image

        img = Image.open(path).convert("L")
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: cannot read the image {path} ({err})") from None
    width = max(1, round(img.width * height / img.height))
    return np.asarray(img.resize((width, height), Image.BILINEAR), dtype=np.float32) / 255.0


def read_wav(path: str, rate: int = 16000) -> np.ndarray:
    """A mono 16-bit WAV file at ``rate`` Hz as float32 samples in [-1, 1]."""
    import wave

    try:
        with wave.open(path) as w:
            if w.getframerate() != rate or w.getnchannels() != 1 or w.getsampwidth() != 2:
                raise SystemExit(f"error: {path} must be mono 16-bit PCM at {rate} Hz (got {w.getnchannels()} "
                                 f"channel(s), {8 * w.getsampwidth()} bit, {w.getframerate()} Hz); convert it "
                                 f"with e.g. `sox {path} -r {rate} -c 1 -b 16 out.wav`")
            pcm = w.readframes(w.getnframes())
    except (OSError, EOFError, wave.Error) as err:
        raise SystemExit(f"error: cannot read the WAV file {path} ({err})") from None
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def print_alignment(res: dict) -> None:
    src = res["source_pieces"]
    print(" " * 14 + " ".join(f"{p[:6]:>6}" for p in src))
    for piece, row in zip(res["target_pieces"], res["attention"]):
        print(f"{piece[:13]:>13} " + " ".join(f"{w:6.2f}" for w in row))


if __name__ == "__main__":
    main()
