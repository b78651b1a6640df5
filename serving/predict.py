"""``attnzoo predict`` and ``attnzoo translate``: ask a server (REST ``--url`` or gRPC ``--grpc``) or,
with ``--local``, the published model in this process, about files and texts given on the command
line. The clients themselves are serving/client.py and serving/grpc_client.py."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from serving.client import Client, LocalClient, ServerError
from serving.protocol import DATATYPES


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Ask a running attnzoo server for a prediction (or, with --local, "
                                             "run the published model in this process).")
    ap.add_argument("model", help="a published model name, e.g. bahdanau")
    ap.add_argument("input", nargs="+", metavar="INPUT",
                    help="text for a text model; an image, .wav or .npy file for an image or speech model; otherwise "
                         "JSON ({input name: nested list}) or a .json file holding it. Several: one answer each, "
                         "in order, after the input and a tab")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    ap.add_argument("--grpc", metavar="HOST:PORT", default=None,
                    help="ask the server over gRPC at HOST:PORT (its --grpc-port) instead of REST at --url")
    ap.add_argument("--local", action="store_true",
                    help="no server: load the model from --repository and answer in this process")
    ap.add_argument("--repository", type=Path, default=Path("model_repository"),
                    help="with --local: the model repository folder (default %(default)s)")
    ap.add_argument("--version", default=None, help="a published version (default: the server's default, "
                                                    "the newest promoted one)")
    ap.add_argument("--decode", choices=("beam", "greedy"), default="beam", help="text models: search")
    ap.add_argument("--attention", action="store_true", help="also print the attention weights")
    args = ap.parse_args(argv)
    client = make_client(args)
    several = len(args.input) > 1
    try:
        meta = client.model_metadata(args.model, args.version)
        if [i["datatype"] for i in meta["inputs"]] == ["BYTES"] and meta["inputs"][0]["name"] == "text":
            # one request for all the sentences: the server batches them
            for text, res in zip(args.input, client.translate(args.model, args.input, args.decode, args.version)):
                print(f"{text}\t{res['translation']}" if several else res["translation"])
                if args.attention:
                    print_alignment(res)
            return
        for item in args.input:
            answer = predict_one(client, meta, args, item)
            print(f"{item}\t{answer[0]}" if several else answer[0])
            for line in answer[1:]:
                print(line)
    except ServerError as err:
        print(f"error: {err}", file=sys.stderr)
        raise SystemExit(2) from None


def make_client(args) -> Client:
    """The client the command line asks for: in process (--local), gRPC (--grpc) or REST (--url)."""
    if args.local and args.grpc:
        raise SystemExit("error: --local answers in this process and --grpc asks a server; give one of them")
    if args.local:
        return LocalClient(args.repository)
    if args.grpc:
        from serving.grpc_client import GrpcClient  # grpcio: only for --grpc

        return GrpcClient(args.grpc)
    return Client(args.url)


def predict_one(client, meta: dict, args, item: str) -> list[str]:
    """The answer to one INPUT of a non-text model: its line, then the --attention lines."""
    names = [i["name"] for i in meta["inputs"]]
    if not item.lstrip().startswith("{"):  # a file of the model's modality, not a JSON object
        if names == ["image", "width"]:  # attention OCR
            return _predict_text_line(client, meta, args, item)
        if names == ["audio", "samples"]:
            return _predict_speech(client, args, item)
        if names == ["image"]:
            return _predict_image(client, meta, args, item)
    return _predict_json(client, meta, args, item)


def _predict_text_line(client, meta: dict, args, item: str) -> list[str]:
    image = read_text_line(item, meta["inputs"][0]["shape"][1])
    outs = client.infer(args.model, {"image": image[None]}, args.version, parameters={"decode": args.decode})
    lines = [str(outs["text"][0])]
    if args.attention:  # each letter's most attended feature column
        for letter, amap in zip(outs["letters"][0], outs["attention"][0]):
            if letter:
                col = int(amap.max(0).argmax())
                lines.append(f"{letter:>4}  peak at column {col} of {amap.shape[1]} (x ≈ {col * 4 + 2} px)")
    return lines


def _predict_speech(client, args, item: str) -> list[str]:
    audio = read_wav(item)
    outs = client.infer(args.model, {"audio": audio[None]}, args.version, parameters={"decode": args.decode})
    lines = [str(outs["text"][0])]
    if args.attention:  # where in the audio each character was read
        for t, row in enumerate(outs["alignment"][0]):
            if row.any():
                lines.append(f"step {t + 1}: peak at encoder step {int(row.argmax())} of {row.shape[0]}")
    return lines


def _predict_image(client, meta: dict, args, item: str) -> list[str]:
    image = read_image(item, tuple(meta["inputs"][0]["shape"][1:]))
    if "caption" not in [o["name"] for o in meta["outputs"]]:  # a classifier (RAM): class, glimpse path
        outs = client.infer(args.model, {"image": image[None]}, args.version)
        lines = [str(int(outs["pred"][0]))]
        if args.attention:
            for t, (x, y) in enumerate(outs["locations"][0]):
                lines.append(f"glimpse {t + 1}: centre x {x:+.2f}, y {y:+.2f} (-1..1 over the image)")
        return lines
    outs = client.infer(args.model, {"image": image[None]}, args.version, parameters={"decode": args.decode})
    lines = [str(outs["caption"][0])]
    if args.attention:  # each word's most attended cell of the feature grid
        for word, amap in zip(outs["words"][0], outs["attention"][0]):
            if word:
                r, c = divmod(int(amap.argmax()), amap.shape[1])
                lines.append(f"{word:>8}  peak at row {r}, column {c} of {amap.shape[0]}x{amap.shape[1]}")
    return lines


def _predict_json(client, meta: dict, args, item: str) -> list[str]:
    try:
        text = Path(item).read_text() if item.endswith(".json") else item
        inputs = json.loads(text)
    except (OSError, ValueError) as err:
        raise SystemExit(f"error: INPUT must be JSON like '{{\"x\": [[...]]}}' or a .json file ({err})") from None
    if not isinstance(inputs, dict):
        raise SystemExit("error: INPUT must be a JSON object mapping input names to nested lists")
    declared = {i["name"]: i["datatype"] for i in meta["inputs"]}
    try:  # JSON has no tensor types: give each input the type the model declares
        inputs = {k: np.asarray(v, dtype=DATATYPES[declared[k]]) if k in declared else v for k, v in inputs.items()}
    except (TypeError, ValueError) as err:
        raise SystemExit(f"error: INPUT does not fit the model's inputs {declared}: {err}") from None
    outs = client.infer(args.model, inputs, args.version)
    shown = outs if args.attention else {k: v for k, v in outs.items() if "weights" not in k}
    return [json.dumps({k: v.tolist() for k, v in shown.items()})]


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




def translate_main(argv: list[str] | None = None) -> None:
    """``attnzoo translate``: a text file in, one translation per line out, in batches."""
    ap = argparse.ArgumentParser(description="Translate a file, one sentence a line, with a published "
                                             "translation model (a server, or --local in this process).")
    ap.add_argument("-i", "--input", type=Path, required=True, help="UTF-8 text, one source sentence a line")
    ap.add_argument("-o", "--output", type=Path, required=True,
                    help="where the translations go, line for line (written when all are done)")
    ap.add_argument("--model", default="bahdanau", help="a published translation model (default %(default)s)")
    ap.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default %(default)s)")
    ap.add_argument("--grpc", metavar="HOST:PORT", default=None,
                    help="ask the server over gRPC at HOST:PORT (its --grpc-port) instead of REST at --url")
    ap.add_argument("--local", action="store_true", help="no server: run the model from --repository here")
    ap.add_argument("--repository", type=Path, default=Path("model_repository"),
                    help="with --local: the model repository folder (default %(default)s)")
    ap.add_argument("--version", default=None, help="a published version (default: the newest promoted one)")
    ap.add_argument("--decode", choices=("beam", "greedy"), default="beam", help="search (default %(default)s)")
    ap.add_argument("--batch", type=int, default=16, help="sentences a request (default %(default)s)")
    ap.add_argument("--nbest", type=int, default=1, metavar="K",
                    help="write the K best beam hypotheses of each line with their scores, in Moses' n-best "
                         "format 'LINE ||| TRANSLATION ||| SCORE' (LINE from 0; blank lines have none); "
                         "default 1: the translation alone, line for line")
    args = ap.parse_args(argv)
    try:
        lines = args.input.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise SystemExit(f"error: cannot read {args.input} as UTF-8 text ({err})") from None
    if args.output.resolve() == args.input.resolve():
        raise SystemExit("error: --output is the input file; name another file so the input is kept")
    if args.batch < 1:
        raise SystemExit("error: --batch must be at least 1")
    if args.nbest < 1 or (args.nbest > 1 and args.decode != "beam"):
        raise SystemExit("error: --nbest must be at least 1, and above 1 only with --decode beam")
    from tqdm.auto import tqdm

    client = make_client(args)
    out: list[str] = []
    try:
        with tqdm(total=len(lines), unit="line", desc=f"translate {args.model}", disable=None) as bar:
            for start in range(0, len(lines), args.batch):
                chunk = lines[start : start + args.batch]
                texts = [t for t in chunk if t.strip()]  # blank lines stay blank, untranslated
                done = iter(client.translate(args.model, texts, args.decode, args.version, args.nbest)) \
                    if texts else iter(())
                for n, text in enumerate(chunk, start=start):
                    result = next(done) if text.strip() else None
                    if args.nbest == 1:
                        out.append(result["translation"] if result else "")
                    elif result:
                        out += [f"{n} ||| {hyp} ||| {score:.4f}" for hyp, score in result["nbest"]]
                bar.update(len(chunk))
    except ServerError as err:
        print(f"error: {err} ({len(out)} of {len(lines)} lines were translated; nothing was written)",
              file=sys.stderr)
        raise SystemExit(2) from None
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text("".join(f"{t}\n" for t in out), encoding="utf-8")
    tmp.replace(args.output)  # all or nothing: an interrupted run never leaves half a file


if __name__ == "__main__":
    main()
