"""Deployment files against what they deploy: the Dockerfile installs only pyproject's torch-free `serve`
extra and starts `serving.server` with flags it has; the KServe manifests follow KServe's own CRD
schemas (deploy/kserve/schemas/, copied from the kserve repository) and fit the image and each other;
the server starts with the image's and the ServingRuntime's arguments in an environment holding only
the serve extra's packages and answers the probes; Triton configs of single-graph models batch."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import urllib.error
import urllib.request
from importlib import metadata
from pathlib import Path

import jsonschema
import numpy as np
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from serving.client import Client
from tests import pod_security
from tests.conftest import ROOT, stop_process
from tests.ports import assert_loopback_only, free_port, wait_serving

pytestmark = pytest.mark.integration  # starts servers or processes

DOCKERFILE, DOCKERIGNORE = ROOT / "Dockerfile", ROOT / ".dockerignore"
KSERVE = ROOT / "deploy" / "kserve"
RUNTIME, ISVC = KSERVE / "serving-runtime.yaml", KSERVE / "inference-service.yaml"
SCHEMAS = {("serving.kserve.io/v1alpha1", "ServingRuntime"): KSERVE / "schemas" / "servingruntime-v1alpha1.json",
           ("serving.kserve.io/v1beta1", "InferenceService"): KSERVE / "schemas" / "inferenceservice-v1beta1.json"}
MODELS = "/mnt/models"  # where KServe puts an InferenceService's storageUri
PORT = 8080  # KServe's default HTTP port
GRPC_PORT = 8081  # and its gRPC one
WRITABLE = ("/tmp",)  # all the server writes, under a read-only root (tempfile's default directory)


def serve_extra() -> list[str]:
    """What `pip install "attnzoo[serve]"` asks for: the base dependencies and the serve extra."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return project["dependencies"] + project["optional-dependencies"]["serve"]


# ---- the Dockerfile -------------------------------------------------------------------------------
def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out, current = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if current and line.lstrip().startswith("#"):  # a comment inside a continued instruction
            continue
        current += line.rstrip()
        if current.endswith("\\"):
            current = current[:-1] + " "
            continue
        word, _, rest = current.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def instruction(name: str) -> list[str]:
    return [args for word, args in dockerfile() if word == name]


def exec_form(args: str) -> list[str]:
    value = json.loads(args)
    assert isinstance(value, list) and all(isinstance(v, str) for v in value), f"not exec (JSON) form: {args}"
    return value


def run_steps() -> list[str]:
    """Each RUN's shell commands, split at `&&`."""
    return [step.strip() for args in instruction("RUN") for step in args.split("&&")]


def pip_installs() -> list[str]:
    """Each `pip install ...` the RUN steps make (either branch of a shell `if`)."""
    return re.findall(r"(?:python3? -m )?pip3? install [^;&]*?(?=\s*(?:;|$))", " && ".join(run_steps()))


def copy_sources() -> list[str]:
    """What the COPY instructions copy into the image, in order."""
    return [src for a in instruction("COPY") for src in shlex.split(a)[:-1]]


def requirements_step() -> str:
    (code,) = [shlex.split(step)[2] for step in run_steps() if step.startswith("python -c") and "tomllib" in step]
    return code


def dockerfile_requirements(onnxruntime: str) -> list[str]:
    """What the Dockerfile's own step writes to requirements-serve.txt, run on this pyproject.toml."""
    done = subprocess.run([sys.executable, "-c", requirements_step()], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "ONNXRUNTIME": onnxruntime}, check=True)
    return done.stdout.splitlines()


def test_dockerfile_installs_the_serve_extra_alone_and_no_torch():
    args = dict(a.split("=", 1) for a in instruction("ARG") if "=" in a)
    assert instruction("FROM") == ["${BASE}"] and args["BASE"].startswith("python:3.1")
    assert args["ONNXRUNTIME"] == "onnxruntime"
    reqs = serve_extra()
    assert not [r for r in reqs if canonicalize_name(Requirement(r).name) == "torch"]
    # The requirements file the image installs is the serve extra, with onnxruntime-gpu swapped in for GPU.
    assert dockerfile_requirements("onnxruntime") == reqs
    gpu = dockerfile_requirements("onnxruntime-gpu")
    assert [Requirement(r).name for r in gpu] == ["onnxruntime-gpu" if Requirement(r).name == "onnxruntime"
                                                  else Requirement(r).name for r in reqs]
    assert {str(Requirement(r).specifier) for r in gpu if "onnxruntime" in r} == \
        {str(Requirement(r).specifier) for r in reqs if Requirement(r).name == "onnxruntime"}
    # The CPU image installs the serve lock, hash-checked; the GPU one that file, held to the lock's versions.
    # Never the project (`pip install .` / ".[serve]" bring torch along).
    installs = pip_installs()
    assert installs == ["pip install --require-hashes -r requirements-serve.lock",
                        "pip install -c requirements-serve.constraints -r requirements-serve.txt"]
    (constraints,) = [s for s in run_steps() if s.startswith("sed ") and "requirements-serve.constraints" in s]
    done = subprocess.run(shlex.split(constraints.split(">")[0]), cwd=ROOT, capture_output=True, text=True, check=True)
    pins = [Requirement(line) for line in done.stdout.splitlines()
            if line.strip() and not line.lstrip().startswith("#")]
    assert pins and all(len(r.specifier) == 1 and next(iter(r.specifier)).operator == "==" for r in pins)
    # The image's torch guard fails where torch is installed (it is, in this development environment).
    (guard,) = [shlex.split(s)[2] for s in run_steps() if s.startswith("python -c") and "torch" in s]
    done = subprocess.run([sys.executable, "-c", guard], capture_output=True, text=True)
    assert done.returncode != 0 and "torch is installed" in done.stderr
    # Copied in: pyproject.toml, the serve lock and the serving package, nothing of models/ or pipeline/.
    sources = copy_sources()
    assert sources == ["pyproject.toml", "requirements-serve.lock", "serving/"]
    ignore = [line.strip() for line in DOCKERIGNORE.read_text().splitlines() if line.strip()[:1] not in ("", "#")]
    assert ignore[0] == "*"  # an allow list: what is not named is not sent to the build
    assert all(f"!{src}" in ignore for src in sources), "a COPY source is kept out of the build context"


def test_dockerfile_runs_the_server_as_non_root_on_8080_with_its_real_flags():
    (user,) = instruction("USER")
    uid = user.split(":")[0]
    assert uid.isdigit() and int(uid) != 0  # numeric, so that runAsNonRoot can check it
    assert instruction("EXPOSE") == [f"{PORT} {GRPC_PORT}"]
    (health,) = instruction("HEALTHCHECK")
    assert "CMD" in health and f"127.0.0.1:{PORT}/v2/health/ready" in health
    (entrypoint,), (cmd,) = instruction("ENTRYPOINT"), instruction("CMD")
    assert exec_form(entrypoint) == ["python", "-m", "serving.server"]
    cmd = exec_form(cmd)
    assert cmd == ["--host", "0.0.0.0", "--port", str(PORT), "--grpc-port", str(GRPC_PORT), "--repository", MODELS,
                   "--no-playground"]
    flags = server_flags()
    assert {a for a in cmd if a.startswith("--")} <= flags
    container = manifest(RUNTIME)["spec"]["containers"][0]
    assert {a.split("=")[0] for a in container["args"] if a.startswith("--")} <= flags
    # deploy/README.md's table states the command the image runs, each part where ENTRYPOINT and CMD give it
    readme = (ROOT / "deploy" / "README.md").read_text()
    stated = re.search(r"entrypoint `([^`]+)`, default arguments \(`CMD`\) `([^`]+)`", readme)
    assert stated, "deploy/README.md: the image's entrypoint and default arguments"
    assert (stated.group(1).split(), stated.group(2).split()) == (exec_form(entrypoint), cmd)


def test_the_docs_state_the_dockerfiles_installs_copies_and_ports():
    """deploy/README.md quotes each pip install of the Dockerfile, names every file it copies and its EXPOSE line;
    it and docs/serving.md give the exposed ports as REST and gRPC."""
    readme = " ".join((ROOT / "deploy" / "README.md").read_text().split())
    installs = pip_installs()
    assert installs and all(f"`{cmd}`" in readme for cmd in installs), installs
    sources = copy_sources()
    named = ", ".join(f"`{s}`" for s in sources[:-1]) + f" and `{sources[-1]}`"
    assert f"it copies {named} only" in readme, named
    (expose,) = instruction("EXPOSE")
    assert f"`EXPOSE {expose}`" in readme
    serving = " ".join((ROOT / "docs" / "serving.md").read_text().split())
    for text in (readme, serving):
        assert re.findall(r"ports (\d+) \(REST\) and (\d+) \(gRPC\)", text) == [(str(PORT), str(GRPC_PORT))]


def server_flags() -> set[str]:
    done = subprocess.run([sys.executable, "-m", "serving.server", "--help"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    return set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


# ---- the KServe manifests against KServe's CRD schemas --------------------------------------------
def manifest(path: Path) -> dict:
    (doc,) = list(yaml.safe_load_all(path.read_text()))
    return doc


def _list_map_keys(validator, keys, instance, schema):
    """x-kubernetes-list-type: map: no two items share their key fields (e.g. a container's ports)."""
    if validator.is_type(instance, "array"):
        seen = set()
        for item in instance:
            key = tuple(json.dumps(item.get(k)) for k in keys) if isinstance(item, dict) else None
            if key in seen:
                yield jsonschema.ValidationError(f"duplicate entry for key {dict(zip(keys, key))}")
            seen.add(key)


KubeValidator = jsonschema.validators.extend(jsonschema.Draft7Validator, {"x-kubernetes-list-map-keys": _list_map_keys})


def strict(schema):
    """As the API server with strict field validation (kubectl's default): unknown fields are errors,
    except under x-kubernetes-preserve-unknown-fields; list-type set items are unique."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in schema:
        out["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if not schema.get("x-kubernetes-preserve-unknown-fields"):
            out.setdefault("additionalProperties", False)
    for key in ("items", "additionalProperties", "not"):
        if isinstance(schema.get(key), dict):
            out[key] = strict(schema[key])
    for key in ("anyOf", "allOf", "oneOf"):
        if key in schema:
            out[key] = [strict(sub) for sub in schema[key]]
    if schema.get("x-kubernetes-list-type") == "set":
        out["uniqueItems"] = True
    return out


def validate(doc: dict) -> list[str]:
    schema = json.loads(SCHEMAS[(doc["apiVersion"], doc["kind"])].read_text())
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 63, "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$"},  # DNS-1035 label
        "namespace": {"type": "string"}, "labels": {"type": "object"}, "annotations": {"type": "object"}}}
    validator = KubeValidator(strict(schema))
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


@pytest.mark.parametrize("path", [RUNTIME, ISVC], ids=["ServingRuntime", "InferenceService"])
def test_manifests_follow_kserves_crd_schemas(path):
    doc = manifest(path)
    assert (doc["apiVersion"], doc["kind"]) in SCHEMAS
    assert validate(doc) == []


def test_the_schema_check_catches_mistakes():
    isvc, runtime = manifest(ISVC), manifest(RUNTIME)
    isvc["spec"]["predictor"]["model"]["storageURI"] = isvc["spec"]["predictor"]["model"].pop("storageUri")
    assert any("storageURI" in e for e in validate(isvc))
    isvc = manifest(ISVC)
    isvc["spec"]["predictor"]["minReplicas"] = "one"
    assert any("minReplicas" in e for e in validate(isvc))
    del runtime["spec"]["containers"]
    assert any("'containers' is a required property" in e for e in validate(runtime))
    runtime = manifest(RUNTIME)
    runtime["spec"]["containers"][0]["resources"]["limits"]["cpu"] = "2 cores"
    assert any("limits/cpu" in e for e in validate(runtime))
    runtime = manifest(RUNTIME)
    runtime["spec"]["containers"][0]["ports"].append(dict(runtime["spec"]["containers"][0]["ports"][0]))
    assert any("duplicate" in e for e in validate(runtime))


def test_inference_service_uses_the_runtime_and_the_runtime_the_image():
    isvc, runtime = manifest(ISVC), manifest(RUNTIME)
    model = isvc["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    formats = runtime["spec"]["supportedModelFormats"]
    assert model["modelFormat"] in [{k: f.get(k) for k in model["modelFormat"]} for f in formats]
    assert model["modelFormat"]["name"] == "attnzoo"
    assert model["protocolVersion"] == "v2" and "v2" in runtime["spec"]["protocolVersions"]
    assert re.match(r"^(pvc|s3|gs)://[a-z0-9][-a-z0-9.]*/\S+$", model["storageUri"])
    (container,) = runtime["spec"]["containers"]
    assert container["name"] == "kserve-container"  # the container KServe mounts /mnt/models into
    assert container["image"].rsplit("/", 1)[-1].startswith("attnzoo-serve:")
    # Image tags are the package's version (pyproject.toml): a release that bumps it bumps them, or fails here.
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert container["image"].endswith(f"attnzoo-serve:{version}")
    for doc in (ROOT / "deploy" / "README.md", DOCKERFILE):
        tags = set(re.findall(r"attnzoo-serve:([\w.+-]+)", doc.read_text()))
        assert tags and tags <= {version, f"{version}-cuda"}, (doc.name, tags)
    args = dict(a.split("=", 1) for a in container["args"] if "=" in a)
    assert args["--host"] == "0.0.0.0" and args["--port"] == str(PORT) and args["--repository"] == MODELS
    assert "--no-playground" in container["args"]  # production: the protocol only
    assert [p["containerPort"] for p in container["ports"]] == [PORT, GRPC_PORT]
    assert args["--grpc-port"] == str(GRPC_PORT)
    assert container["ports"][1]["name"] == "h2c"  # how KServe knows its gRPC port
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["port"] == PORT
    assert container["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert container["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    (user,) = instruction("USER")
    assert container["securityContext"]["runAsNonRoot"] and container["securityContext"]["runAsUser"] == int(
        user.split(":")[0])
    annotations = runtime["spec"]["annotations"]
    assert annotations["prometheus.kserve.io/port"] == str(PORT)
    assert annotations["prometheus.kserve.io/path"] == "/metrics"


def kserve_pod() -> tuple[dict, dict]:
    """The pod KServe makes of the two manifests (metadata, spec): the ServingRuntime's containers, volumes,
    annotations and host settings, the InferenceService predictor's pod fields, and the volume of a pvc://
    storageUri."""
    runtime, predictor = manifest(RUNTIME)["spec"], manifest(ISVC)["spec"]["predictor"]
    spec = {k: v for k, v in predictor.items() if k not in ("model", "minReplicas", "maxReplicas", "annotations",
                                                            "labels")}
    spec["containers"] = runtime["containers"]
    spec["volumes"] = runtime.get("volumes", []) + predictor.get("volumes", [])
    if predictor["model"]["storageUri"].startswith("pvc://"):
        claim = predictor["model"]["storageUri"].split("/")[2]
        spec["volumes"].append({"name": "kserve-pvc-source", "persistentVolumeClaim": {"claimName": claim}})
    spec.update({k: runtime[k] for k in ("hostIPC",) if k in runtime})
    return {"annotations": {**runtime.get("annotations", {}), **predictor.get("annotations", {})}}, spec


def test_kserve_pod_passes_the_restricted_pod_security_standard():
    """A cluster that enforces the "restricted" Pod Security level refuses a pod without
    readOnlyRootFilesystem or seccompProfile RuntimeDefault. The pod the manifests make passes every restricted
    control (tests/pod_security.py), and its container's root file system is read-only, with an emptyDir
    at each path the server writes to (/tmp: --workers N keeps its Prometheus files there)."""
    meta, spec = kserve_pod()
    assert pod_security.violations(meta, spec) == []
    (container,) = spec["containers"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    empty = {v["name"] for v in spec["volumes"] if "emptyDir" in v}
    writable = {m["mountPath"] for m in container.get("volumeMounts", []) if m["name"] in empty}
    assert writable == set(WRITABLE)


# ---- the server in an environment with only the serve extra, started as the image starts it --------
def serve_closure(requirements: list[str] | None = None) -> list[metadata.Distribution]:
    """The installed distributions the serve extra (or ``requirements``) resolves to here (onnxruntime:
    the build installed, as the Dockerfile's ONNXRUNTIME argument swaps it), following every dependency
    and extra."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset]] = set()

    def name_of(name: str) -> str:
        name = canonicalize_name(name)
        if name == "onnxruntime":
            for build in ("onnxruntime", "onnxruntime-gpu"):
                try:
                    metadata.distribution(build)
                    return build
                except metadata.PackageNotFoundError:
                    pass
        return name

    def add(req: Requirement) -> None:
        name = name_of(req.name)
        if (name, frozenset(req.extras)) in seen:
            return
        seen.add((name, frozenset(req.extras)))
        dist = found.setdefault(name, metadata.distribution(name))
        for spec in dist.requires or []:
            sub = Requirement(spec)
            if sub.marker is None or any(sub.marker.evaluate({"extra": e}) for e in ["", *req.extras]):
                add(sub)

    for spec in serve_extra() if requirements is None else requirements:
        add(Requirement(spec))
    return list(found.values())


TRAINING_STACK = {"torch", "accelerate", "ray", "mlflow", "dvc", "onnx", "onnxscript", "scipy"}


def test_the_serve_extra_resolves_without_torch():
    names = {canonicalize_name(d.metadata["Name"]) for d in serve_closure()}
    assert {"fastapi", "uvicorn", "numpy", "sentencepiece", "orjson", "prometheus-client", "uvloop"} <= names
    assert not names & TRAINING_STACK


def test_pip_install_attnzoo_serve_is_the_server_and_train_the_pipeline():
    """As pip resolves ``attnzoo[serve]`` from the installed package's own metadata: everything serving/
    imports and nothing of the training stack; ``attnzoo[train]`` brings that stack."""
    serve = {canonicalize_name(d.metadata["Name"]) for d in serve_closure(["attnzoo[serve]"])}
    assert "attnzoo" in serve and not serve & TRAINING_STACK, serve & TRAINING_STACK
    imported = set()  # top-level modules that serving/ imports, standard library and itself aside
    for path in (ROOT / "serving").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                imported.add(node.module.split(".")[0])
    imported -= set(sys.stdlib_module_names) | {"serving", "triton_python_backend_utils"}  # Triton provides the last
    imported -= {"mlflow"}  # serving/pyfunc.py: loaded by MLflow only, which is there when it loads it
    provided = {top for d in serve_closure(["attnzoo[serve]"]) for top in _top_levels(d)}
    missing = sorted(imported - provided)
    assert not missing, f"serving/ imports {missing}, which attnzoo[serve] does not install"
    train = {canonicalize_name(d.metadata["Name"]) for d in serve_closure(["attnzoo[train]"])}
    assert TRAINING_STACK <= train


def _top_levels(dist: metadata.Distribution) -> set[str]:
    """The importable top-level names of an installed distribution."""
    text = dist.read_text("top_level.txt")
    if text:
        return set(text.split())
    return {Path(str(f)).parts[0].removesuffix(".py") for f in dist.files or []
            if not str(f).startswith("..") and ".dist-info" not in str(f)}


def image_like(tmp: Path) -> tuple[Path, Path]:
    """site-packages with only the serve extra's distributions (links), and /app with serving/ only."""
    site, app = tmp / "site-packages", tmp / "app"
    site.mkdir()
    app.mkdir()
    for dist in serve_closure():
        for top in {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}:
            target = Path(dist.locate_file(top))
            if target.exists() and not (site / top).exists():
                (site / top).symlink_to(target)
    (app / "serving").symlink_to(ROOT / "serving")
    return site, app


def publish_tiny(repo: Path, work: Path) -> np.ndarray:
    """A one-graph model (y = x @ w, batch axis free) published as the pipeline publishes: `tiny`."""
    from pipeline.stages.publish import write_version

    w = np.arange(6, dtype=np.float32).reshape(3, 2) / 10
    tiny_onnx(work / "tiny", {"x": ["batch", 3]}, {"y": ["batch", 2]}, w)
    meta, created, _ = write_version(repo / "tiny", "tiny", work / "tiny", {"loop": "single"},
                                  {"arch": "tiny", "task": "none", "parity_passed": True, "production": True}, [])
    assert created and meta["graphs"] == ["model"]
    return w


def tiny_onnx(folder: Path, inputs: dict, outputs: dict, w: np.ndarray) -> None:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    folder.mkdir(parents=True)
    (x,), (y,) = inputs, outputs
    graph = helper.make_graph([helper.make_node("MatMul", [x, "w"], [y])], "tiny",
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, inputs[x])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, outputs[y])],
                              [numpy_helper.from_array(w, "w")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, folder / "model.onnx")


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as err:
        return err.code, err.read()


def read_only_root(cmd: list[str], tmp: Path) -> list[str]:
    """``cmd`` in its own mount namespace where, as in the pod with readOnlyRootFilesystem, only WRITABLE
    (the manifest's emptyDir paths) can be written: / is remounted read-only, and so is the test's own
    folder ``tmp`` (image, model repository, home), should it lie under a writable path."""
    script = ["set -e", "mount --make-rprivate /", *[f"mount --bind {w} {w}" for w in WRITABLE],
              "mount -o remount,bind,ro /", f"mount --bind {tmp} {tmp}", f"mount -o remount,bind,ro {tmp}",
              'exec "$@"']
    return ["unshare", "--mount", "sh", "-c", "; ".join(script), "sh", *cmd]


def _read_only_root_works(tmp: Path, env: dict) -> bool:
    """Whether this machine lets a test make a mount namespace (root, or a user namespace), and if so that
    the sandbox refuses a write to / and to ``tmp`` and allows one under WRITABLE."""
    probe = ("import os, sys, tempfile\n"
             "for path in sys.argv[1:]:\n"
             "    try:\n        open(os.path.join(path, 'probe'), 'w')\n        sys.exit(f'wrote {path}')\n"
             "    except OSError:\n        pass\n"
             "tempfile.mkdtemp()\n")
    done = subprocess.run(read_only_root([sys.executable, "-S", "-c", probe, "/", str(tmp)], tmp), env=env,
                          capture_output=True, text=True, timeout=30)
    if "unshare" in done.stderr or "mount:" in done.stderr:
        return False
    assert done.returncode == 0, done.stderr
    return True


@pytest.mark.parametrize("started_by", ["Dockerfile", "ServingRuntime", "ServingRuntime, read-only root"])
def test_server_starts_as_deployed_with_only_the_serve_extra_and_answers_the_probes(started_by, tmp_path):
    """The last case runs the server as the ServingRuntime's pod does, with only WRITABLE writable (its
    readOnlyRootFilesystem)."""
    repo = tmp_path / "model_repository"
    w = publish_tiny(repo, tmp_path / "work")
    site, app = image_like(tmp_path)
    if started_by == "Dockerfile":
        args = exec_form(instruction("ENTRYPOINT")[0])[1:] + exec_form(instruction("CMD")[0])
    else:
        args = ["-m", "serving.server", *manifest(RUNTIME)["spec"]["containers"][0]["args"]]
    port, grpc_port = free_port(), free_port()
    # The deployed command as written but for its folders, ports and address: a pod listens on every interface
    # of its own network, a test on loopback only.
    assert "0.0.0.0" in " ".join(args)
    args = [a.replace(MODELS, str(repo)).replace(str(PORT), str(port)).replace(str(GRPC_PORT), str(grpc_port))
            .replace("0.0.0.0", "127.0.0.1") for a in args]
    assert str(repo) in " ".join(args) and str(port) in " ".join(args)
    # -S: no site-packages but the image-like one; cwd /app-like: `serving` and nothing else of the project.
    env = {"PATH": os.environ["PATH"], "PYTHONPATH": str(site), "HOME": str(tmp_path)}
    cmd = [sys.executable, "-S", *args]
    if started_by.endswith("read-only root"):
        if not _read_only_root_works(tmp_path, env):
            pytest.skip("this machine lets no test make a mount namespace (unshare --mount needs root)")
        cmd = read_only_root(cmd, tmp_path)
    proc = subprocess.Popen(cmd, cwd=app, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        base = f"http://127.0.0.1:{port}"
        # Ready, and on its own port (not another worker's server handed the same port first).
        if not wait_serving(proc, port, Client(base, timeout=5).ready, 60):
            raise AssertionError("the server never became ready" + (
                f"; it exited:\n{proc.stdout.read()}" if proc.poll() is not None else ""))
        assert_loopback_only(port)
        # Docker's HEALTHCHECK command as written, on this port, in the same image-like environment.
        (health,) = instruction("HEALTHCHECK")
        check = exec_form(health.split("CMD", 1)[1].strip())
        assert check[0] == "python"
        check = [sys.executable, "-S", *[a.replace(f":{PORT}/", f":{port}/") for a in check[1:]]]
        assert subprocess.run(check, cwd=app, env=env, timeout=30).returncode == 0
        container = manifest(RUNTIME)["spec"]["containers"][0]
        for probe in ("readinessProbe", "livenessProbe"):
            assert _get(base + container[probe]["httpGet"]["path"])[0] == 200
        assert _get(base + manifest(RUNTIME)["spec"]["annotations"]["prometheus.kserve.io/path"])[0] == 200
        x = np.array([[1, 2, 3], [0, -1, 0.5]], dtype=np.float32)
        body = json.dumps({"inputs": [{"name": "x", "shape": [2, 3], "datatype": "FP32",
                                       "data": x.ravel().tolist()}]}).encode()
        req = urllib.request.Request(f"{base}/v2/models/tiny/infer", body, {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            (out,) = json.loads(r.read())["outputs"]
        assert out["name"] == "y" and out["shape"] == [2, 2]
        np.testing.assert_allclose(np.array(out["data"]).reshape(2, 2), x @ w, rtol=1e-6)
        # the gRPC port too, served by the serve extra alone: ServerReady's empty request -> ready = true
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{grpc_port}") as channel:
            ready = channel.unary_unary("/inference.GRPCInferenceService/ServerReady")
            assert ready(b"", timeout=10) == b"\x08\x01"
        assert_loopback_only(grpc_port)
    finally:
        stop_process(proc, timeout=20)


# ---- Triton: single-graph models with a free batch axis batch dynamically --------------------------
def triton_config(text: str):
    """Parse config.pbtxt with Triton's own ModelConfig schema (shipped in tritonclient)."""
    import importlib.util

    import tritonclient
    from google.protobuf import text_format

    spec = importlib.util.spec_from_file_location(
        "model_config_pb2", Path(tritonclient.__file__).parent / "grpc" / "model_config_pb2.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # not via tritonclient.grpc, which needs grpcio
    return text_format.Parse(text, module.ModelConfig())


def test_single_graph_config_batches_when_every_axis_0_is_free(tmp_path):
    publish_tiny(tmp_path / "repo", tmp_path / "work")
    cfg = triton_config((tmp_path / "repo" / "tiny" / "config.pbtxt").read_text())
    assert cfg.platform == "onnxruntime_onnx" and cfg.max_batch_size == 64 and cfg.HasField("dynamic_batching")
    assert cfg.dynamic_batching.max_queue_delay_microseconds > 0
    # dims: the ONNX shapes without axis 0
    assert [(t.name, list(t.dims)) for t in cfg.input] == [("x", [3])]
    assert [(t.name, list(t.dims)) for t in cfg.output] == [("y", [2])]


@pytest.mark.parametrize("inputs,outputs,op,batch,dims", [
    ({"x": [4, 3]}, {"y": [4, 2]}, "MatMul", 0, ([4, 3], [4, 2])),  # fixed axis 0: as exported
    ({"x": ["n", 3]}, {"y": [3]}, "ReduceSum", 0, ([-1, 3], [3])),  # the output has no batch axis
    ({"x": ["n", "t"]}, {"y": ["n"]}, "ReduceMax", 64, ([-1], [])),  # a batch-only output: [1] reshaped to []
], ids=["fixed", "reduced-over-axis-0", "batch-only-output"])
def test_single_graph_config_keeps_shapes_without_a_free_batch_axis(tmp_path, inputs, outputs, op, batch, dims):
    from pipeline.stages.publish import config_pbtxt

    w = np.ones((3, 2), dtype=np.float32)
    if op != "MatMul":
        tiny_reduce(tmp_path / "onnx", inputs, outputs, op, axis=0 if batch == 0 else 1)
    else:
        tiny_onnx(tmp_path / "onnx", inputs, outputs, w)
    (tmp_path / "repo").mkdir()
    cfg = triton_config(config_pbtxt("m", tmp_path / "repo", tmp_path / "onnx", ["model"]))
    assert cfg.max_batch_size == batch and cfg.HasField("dynamic_batching") == bool(batch)
    (given,), (out,) = cfg.input, cfg.output
    assert list(given.dims) == dims[0]
    if batch and not dims[1]:  # Triton wants a dim: [1], reshaped to the [] a batched row really is
        assert list(out.dims) == [1] and out.HasField("reshape") and list(out.reshape.shape) == []
    else:
        assert list(out.dims) == dims[1] and not out.HasField("reshape")


def tiny_reduce(folder: Path, inputs: dict, outputs: dict, op: str, axis: int) -> None:
    import onnx
    from onnx import TensorProto, helper

    folder.mkdir(parents=True)
    (x,), (y,) = inputs, outputs
    axes = helper.make_tensor("axes", TensorProto.INT64, [1], [axis])
    node = helper.make_node(op, [x, "axes"], [y], keepdims=0)
    graph = helper.make_graph([node], "tiny", [helper.make_tensor_value_info(x, TensorProto.FLOAT, inputs[x])],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, outputs[y])], [axes])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, folder / "model.onnx")
