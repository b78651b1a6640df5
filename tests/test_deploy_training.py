"""The training manifests (deploy/training/): the files are the generator's output; the RayJob and the
PyTorchJob follow KubeRay's and the Training Operator's own CRD schemas (deploy/training/schemas/, copied
from the operators' repositories); every pod they make passes the "restricted" Pod Security Standard; the
resources follow params.yaml; the PyTorchJob's launcher and rendezvous are what torchrun reads; and every
command the manifests run is one the CLI accepts (the last test runs each one's --help)."""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests import pod_security
from tests.conftest import ROOT
from tests.test_deploy import KubeValidator, strict

TRAINING = ROOT / "deploy" / "training"
SCHEMAS = {("ray.io/v1", "RayJob"): TRAINING / "schemas" / "rayjob-v1.json",
           ("kubeflow.org/v1", "PyTorchJob"): TRAINING / "schemas" / "pytorchjob-v1.json"}


def generator():
    spec = importlib.util.spec_from_file_location("attnzoo_training_generate", TRAINING / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = generator()


def load(name: str) -> list[dict]:
    return list(yaml.safe_load_all((TRAINING / name).read_text()))


def generated(argv: list[str]) -> dict[str, list[dict]]:
    return GEN.documents(GEN.parser().parse_args(argv))


def the(kind: str, files: dict[str, list[dict]] | None = None) -> dict:
    docs = [d for name in GEN.FILES for d in (files[name] if files else load(name))]
    (doc,) = [d for d in docs if d["kind"] == kind]
    return doc


def validate(doc: dict) -> list[str]:
    schema = json.loads(SCHEMAS[(doc["apiVersion"], doc["kind"])].read_text())
    schema["properties"]["metadata"] = {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "maxLength": 63, "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$"},
        "namespace": {"type": "string"}, "labels": {"type": "object"}, "annotations": {"type": "object"}}}
    validator = KubeValidator(strict(schema))
    return sorted(f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc))


def pods(doc: dict) -> dict[str, dict]:
    """Every pod template of a manifest, by where it sits."""
    spec = doc["spec"]
    if doc["kind"] == "RayJob":
        cluster = spec["rayClusterSpec"]
        out = {"head": cluster["headGroupSpec"]["template"], "submitter": spec["submitterPodTemplate"]}
        out.update({f"worker group {g['groupName']}": g["template"] for g in cluster["workerGroupSpecs"]})
        return out
    if doc["kind"] == "PyTorchJob":
        return {f"replica {k}": r["template"] for k, r in spec["pytorchReplicaSpecs"].items()}
    if doc["kind"] == "Job":
        return {"job": spec["template"]}
    return {}


# ---- the files are the generator's ------------------------------------------------------------------
def test_committed_files_are_the_generators_default_output(tmp_path):
    GEN.main(["--out", str(tmp_path)])
    for name in GEN.FILES:
        assert (tmp_path / name).read_text() == (TRAINING / name).read_text(), f"{name}: run generate.py --out"


def test_entry_nodes_and_image_are_options():
    files = generated(["--entry", "luong_dot", "--nodes", "4", "--image", "r.example/t:1", "--gpus-per-node", "2",
                       "--gpu-image", "r.example/t:1-cuda", "--gpu-workers", "1"])
    job = the("PyTorchJob", files)
    worker = job["spec"]["pytorchReplicaSpecs"]["Worker"]
    (c,) = worker["template"]["spec"]["containers"]
    assert job["metadata"]["name"] == "attnzoo-train-luong-dot" and c["command"][-1] == "luong_dot"
    assert worker["replicas"] == 4 and job["spec"]["elasticPolicy"]["minReplicas"] == 4 == \
        job["spec"]["elasticPolicy"]["maxReplicas"]
    assert job["spec"]["nprocPerNode"] == "2" and c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["image"] == "r.example/t:1-cuda"
    ray = the("RayJob", files)
    images = {p["spec"]["containers"][0]["image"] for p in pods(ray).values()}
    assert images == {"r.example/t:1", "r.example/t:1-cuda"}
    for doc in (job, ray):
        assert validate(doc) == []
        assert all(pod_security.violations(p.get("metadata", {}), p["spec"]) == [] for p in pods(doc).values())
    with pytest.raises(SystemExit, match="no such entry"):
        generated(["--entry", "nope"])


# ---- the operators' CRD schemas -------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["RayJob", "PyTorchJob"])
def test_manifests_follow_the_operators_crd_schemas(kind):
    assert validate(the(kind)) == []


def test_the_schema_check_catches_mistakes():
    ray, job = the("RayJob"), the("PyTorchJob")
    ray["spec"]["entryPoint"] = ray["spec"].pop("entrypoint")
    assert any("entryPoint" in e for e in validate(ray))
    ray = the("RayJob")
    ray["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = "two"
    assert any("replicas" in e for e in validate(ray))
    ray = the("RayJob")
    ray["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "password"
    assert any("authOptions/mode" in e for e in validate(ray))
    del job["spec"]["pytorchReplicaSpecs"]
    assert any("'pytorchReplicaSpecs' is a required property" in e for e in validate(job))
    job = the("PyTorchJob")
    job["spec"]["elasticPolicy"]["nprocPerNode"] = 1  # the field is spec.nprocPerNode (a string)
    assert any("nprocPerNode" in e for e in validate(job))
    job = the("PyTorchJob")
    job["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["resources"]["limits"][
        "cpu"] = "4 cores"
    assert any("limits/cpu" in e for e in validate(job))


# ---- Pod Security -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["workspace.yaml", "rayjob.yaml", "pytorchjob.yaml"])
def test_every_pod_passes_the_restricted_pod_security_standard(name):
    templates = {where: p for doc in load(name) for where, p in pods(doc).items()}
    assert templates
    for where, template in templates.items():
        assert pod_security.violations(template.get("metadata", {}), template["spec"]) == [], where


def test_the_operators_add_no_container_of_their_own_settings():
    """KubeRay copies the Ray container's securityContext into the init container it adds to workers and
    fills the submitter template's command; the Training Operator adds an init container without a
    securityContext to Worker pods only when a Master replica exists, so the PyTorchJob has none."""
    assert set(the("PyTorchJob")["spec"]["pytorchReplicaSpecs"]) == {"Worker"}
    (submitter,) = the("RayJob")["spec"]["submitterPodTemplate"]["spec"]["containers"]
    assert "command" not in submitter  # KubeRay's `ray job submit ...` goes here


# ---- what the manifests run and share ------------------------------------------------------------------
def test_resources_follow_params_yaml_and_the_locks():
    res = yaml.safe_load((ROOT / "params.yaml").read_text())["repro"]["resources"]
    ray = the("RayJob")["spec"]["rayClusterSpec"]
    cpu, gpu = ray["workerGroupSpecs"]
    assert int(cpu["template"]["spec"]["containers"][0]["resources"]["limits"]["cpu"]) >= max(
        r.get("num_cpus", 1) for r in res.values())
    gpu_limits = gpu["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert int(gpu_limits["cpu"]) == max(1, res["train"].get("num_cpus", 1)) * int(gpu_limits["nvidia.com/gpu"])
    assert ray["headGroupSpec"]["rayStartParams"]["num-cpus"] == "0"  # the head runs the driver only
    (lock_ray,) = re.findall(r"^ray==([\d.]+)", (ROOT / "requirements.lock").read_text(), re.M)
    assert ray["rayVersion"] == lock_ray
    assert ray["authOptions"] == {"mode": "token", "secretName": GEN.SECRET}


def test_every_pod_sees_the_checkout_at_the_same_path_and_the_secret():
    for name in GEN.FILES:
        for doc in load(name):
            for where, template in pods(doc).items():
                if where == "submitter":
                    continue
                (c,) = template["spec"]["containers"]
                claims = {v["name"]: v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
                          if "persistentVolumeClaim" in v}
                mounts = {m["mountPath"]: claims.get(m["name"]) for m in c["volumeMounts"]}
                assert mounts[GEN.WORKSPACE] == GEN.PVC, where
                env = {e["name"]: e for e in c["env"]}
                assert env["MLFLOW_TRACKING_URI"]["valueFrom"]["secretKeyRef"]["name"] == GEN.SECRET, where
    (claim,) = [d for d in load("workspace.yaml") if d["kind"] == "PersistentVolumeClaim"]
    assert claim["metadata"]["name"] == GEN.PVC and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert the("RayJob")["spec"]["entrypoint"].startswith(f"cd {GEN.CHECKOUT} && ")
    job = the("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    assert job["workingDir"] == GEN.CHECKOUT


def test_pytorchjob_trains_through_attnzoo_launcher_with_the_operators_rendezvous(monkeypatch):
    """The command is train@'s (dvc.yaml); ATTNZOO_LAUNCHER makes it re-run itself under torchrun, which
    takes nodes, processes per node and the c10d rendezvous on worker 0 from the PET_* variables the
    Training Operator v1.9 sets from this spec (pkg/controller.v1/pytorch/envvar.go, elastic.go)."""
    from torch.distributed.run import get_args_parser

    from pipeline.stages.train import LAUNCHER_ENV, launch_command

    doc = the("PyTorchJob")
    spec, worker = doc["spec"], doc["spec"]["pytorchReplicaSpecs"]["Worker"]
    (c,) = worker["template"]["spec"]["containers"]
    stage = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]["train"]["do"]["cmd"]
    entry = c["command"][-1]
    assert " ".join(c["command"]) == stage.replace("${key}", entry)
    env = {e["name"]: e.get("value") for e in c["env"]}
    port = {p["name"]: p["containerPort"] for p in c["ports"]}["pytorchjob-port"]
    policy = spec["elasticPolicy"]
    operator_env = {"PET_NPROC_PER_NODE": spec["nprocPerNode"], "PET_RDZV_BACKEND": policy["rdzvBackend"],
                    "PET_RDZV_ENDPOINT": f"{doc['metadata']['name']}-worker-0:{port}",
                    "PET_NNODES": f"{policy['minReplicas']}:{policy['maxReplicas']}",
                    "PET_MAX_RESTARTS": str(policy["maxRestarts"])}
    for key, value in operator_env.items():
        monkeypatch.setenv(key, value)
    cmd = launch_command(env[LAUNCHER_ENV], c["command"][3:])
    assert cmd[0] == "torchrun"
    args = get_args_parser().parse_args(cmd[1:])
    assert args.module and args.training_script == "pipeline.stages.train" and args.training_script_args == [entry]
    assert args.nnodes == f"{worker['replicas']}:{worker['replicas']}" and args.nproc_per_node == "1"
    assert args.rdzv_backend == "c10d" and args.rdzv_endpoint == f"attnzoo-train-{entry}-worker-0:{port}"


# ---- every command the manifests run is the CLI's -------------------------------------------------------
def commands() -> list[list[str]]:
    """Every command line in the manifests: the workspace Job's shell steps, the RayJob's entrypoint, the
    PyTorchJob's command and the launcher it re-runs under."""
    (job,) = [d for d in load("workspace.yaml") if d["kind"] == "Job"]
    (c,) = job["spec"]["template"]["spec"]["containers"]
    assert c["command"][:2] == ["sh", "-c"]
    steps = c["command"][2].split(" && ") + the("RayJob")["spec"]["entrypoint"].split(" && ")
    worker = the("PyTorchJob")["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]
    launcher = {e["name"]: e.get("value") for e in worker["env"]}["ATTNZOO_LAUNCHER"]
    return [shlex.split(s) for s in steps] + [worker["command"], shlex.split(launcher)]


def help_of(cmd: list[str]) -> tuple[list[str], list[str]]:
    """(the --help command for this command line, the options it uses)."""
    options = [a.split("=")[0] for a in cmd if a.startswith("-") and a not in ("-m", "-c")]
    if cmd[0] == "python":
        module = cmd[2]
        sub = [cmd[3]] if module == "pipeline.runner.cli" else []
        return [sys.executable, "-m", module, *sub, "--help"], options
    if cmd[0] == "git":
        return ["git", cmd[1], "-h"], options
    if cmd[0] == "dvc":
        words = [a for a in cmd[1:] if not a.startswith("-")]
        return [str(Path(sys.executable).with_name("dvc")), *words[:2], "--help"], options
    if cmd[0] == "torchrun":
        return [str(Path(sys.executable).with_name("torchrun")), "--help"], options
    raise AssertionError(f"a command the test does not know: {cmd}")


@pytest.mark.integration  # runs each command's --help
def test_every_command_in_the_manifests_is_one_the_cli_accepts():
    seen = set()
    for cmd in commands():
        if cmd[0] == "cd":
            assert cmd == ["cd", GEN.CHECKOUT]
            continue
        help_cmd, options = help_of(cmd)
        done = subprocess.run(help_cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode in (0, 129 if cmd[0] == "git" else 0), (help_cmd, done.stderr[-2000:])
        text = done.stdout + done.stderr
        known = set(re.findall(r"(?<![\w-])--?[a-zA-Z][\w-]*", text))
        assert set(options) <= known, (cmd, set(options) - known)
        seen.add(tuple(help_cmd[1:4]) if cmd[0] == "python" else cmd[0])
    repro = [c for c in commands() if c[:4] == ["python", "-m", "pipeline.runner.cli", "repro"]]
    assert repro == [["python", "-m", "pipeline.runner.cli", "repro", "--ray"]]  # `attnzoo repro --ray`
    assert {"git", "dvc", "torchrun"} <= seen
