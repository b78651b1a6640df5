"""Kubernetes manifests for training attnzoo on a cluster (docs/cluster.md, Kubernetes): a shared workspace
(a ReadWriteMany PVC and a Job that checks the repository out there and pulls the DVC outputs), a KubeRay
RayJob that runs `attnzoo repro --ray` on a Ray cluster, and a Training Operator PyTorchJob that trains one
params.yaml entry on N nodes through ATTNZOO_LAUNCHER.

The manifests are built as data here (PyYAML writes them; no template language): the entry, the node
count and the images are options, every other value is fixed below. With no options it writes the files
committed beside it, which `tests/test_deploy_training.py` checks against the operators' CRD schemas and
the "restricted" Pod Security Standard.

    python deploy/training/generate.py --entry ntm --nodes 4 --image REGISTRY/attnzoo-train:TAG | kubectl apply -f -
    python deploy/training/generate.py --out deploy/training          # rewrite the committed files
"""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
IMAGE = "registry.example.com/attnzoo/attnzoo-train:0.1.0"
WORKSPACE = "/workspace"  # the PVC's mount point on every pod
CHECKOUT = f"{WORKSPACE}/attnzoo"  # the repository: the same absolute path on every node (docs/cluster.md)
SECRET = "attnzoo-cluster"  # auth_token (KubeRay's key for the Ray token), MLFLOW_TRACKING_URI, DVC_REMOTE_URL
PVC = "attnzoo-workspace"
UID = 10001  # any non-root user; fsGroup makes the PVC writable for it
RAY_VERSION = "2.60.0"  # requirements.lock's ray: KubeRay's token auth needs 2.52 or later
RDZV_PORT = 23456  # the Training Operator's default port, named pytorchjob-port


def params_resources() -> dict:
    """params.yaml `repro.resources`: what `attnzoo repro --ray` asks of the cluster per stage kind."""
    return yaml.safe_load((ROOT / "params.yaml").read_text())["repro"]["resources"]


def pod_security() -> dict:
    """Pod-level settings of every pod here: the "restricted" Pod Security Standard's non-root user and
    RuntimeDefault seccomp profile (containers also drop every capability and privilege escalation)."""
    return {"runAsNonRoot": True, "runAsUser": UID, "runAsGroup": UID, "fsGroup": UID,
            "seccompProfile": {"type": "RuntimeDefault"}}


def container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def secret_env(*keys: str, optional: tuple[str, ...] = ()) -> list[dict]:
    env = [{"name": k, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": k}}} for k in keys]
    return env + [{"name": k, "valueFrom": {"secretKeyRef": {"name": SECRET, "key": k, "optional": True}}}
                  for k in optional]


def common_env() -> list[dict]:
    """HOME under /tmp (the image's user has no home: Ray, torch and DVC keep their caches there), MLflow's
    server, and S3 credentials for a DVC remote on S3 when the Secret has them."""
    return [{"name": "HOME", "value": "/tmp"},
            *secret_env("MLFLOW_TRACKING_URI", optional=("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"))]


def workspace_volume() -> tuple[dict, dict]:
    return ({"name": "workspace", "persistentVolumeClaim": {"claimName": PVC}},
            {"name": "workspace", "mountPath": WORKSPACE})


def pod(containers: list[dict], restart: str | None = None, volumes: list[dict] | None = None) -> dict:
    spec = {"securityContext": pod_security(), "containers": containers,
            "volumes": [workspace_volume()[0], *(volumes or [])]}
    if restart:
        spec["restartPolicy"] = restart
    return {"spec": spec}


def resources(cpus: int | str, memory: str, gpus: int = 0) -> dict:
    amount = {"cpu": str(cpus), "memory": memory, **({"nvidia.com/gpu": str(gpus)} if gpus else {})}
    return {"requests": dict(amount), "limits": dict(amount)}


def checkout_steps(repository: str, revision: str) -> list[str]:
    """The workspace Job's shell steps: check REVISION out at CHECKOUT (again, on a re-run), point DVC at the
    Secret's remote (in .dvc/config.local, so the checkout stays clean) and pull the pipeline's outputs."""
    return [f"git init -q {CHECKOUT}", f"cd {CHECKOUT}",
            f"git fetch -q --depth 1 {shlex.quote(repository)} {shlex.quote(revision)}",
            "git checkout -q --detach --force FETCH_HEAD",
            'dvc remote add --local --force --default cluster "$DVC_REMOTE_URL"',
            "python -m pipeline.runner.cli pull"]


def workspace(image: str, repository: str, revision: str, storage: str) -> list[dict]:
    """The PVC every training pod mounts (the checkout and its DVC cache) and the Job that fills it."""
    claim = {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": {"name": PVC},
             "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": storage}}}}
    mount = workspace_volume()[1]
    container = {"name": "checkout", "image": image, "command": ["sh", "-c", " && ".join(
        checkout_steps(repository, revision))], "env": [*common_env(), *secret_env("DVC_REMOTE_URL")],
        "volumeMounts": [mount], "resources": resources(1, "2Gi"), "securityContext": container_security()}
    job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "attnzoo-checkout"},
           "spec": {"backoffLimit": 2, "ttlSecondsAfterFinished": 3600,
                    "template": pod([container], restart="Never")}}
    return [claim, job]


def ray_steps() -> list[str]:
    """The RayJob's entrypoint (a shell command the Ray job runs on the head): the whole pipeline across the
    cluster from the shared checkout, then its outputs to the DVC remote."""
    return [f"cd {CHECKOUT}", "python -m pipeline.runner.cli repro --ray", "python -m pipeline.runner.cli push"]


def ray_container(name: str, image: str, cpus: int | str, memory: str, gpus: int = 0) -> dict:
    env = common_env() + (secret_env("DVC_REMOTE_URL") if name == "ray-head" else [])
    return {"name": name, "image": image, "env": env, "volumeMounts": [workspace_volume()[1]],
            "resources": resources(cpus, memory, gpus), "securityContext": container_security()}


def rayjob(image: str, gpu_image: str, workers: int, gpu_workers: int, cpus: int, gpus: int, memory: str) -> dict:
    """KubeRay RayJob: a head that runs only the driver (num-cpus 0), a CPU worker group for the stages and
    tune@'s trials, a GPU worker group for train@ when params.yaml gives train a GPU; token auth from the
    Secret's auth_token. The cluster is deleted when the job ends."""
    res = params_resources()
    need = max(r.get("num_cpus", 1) for r in res.values())
    if cpus < need:
        raise SystemExit(f"error: --cpus-per-node {cpus}: params.yaml repro.resources asks up to {need} CPUs a stage")
    gpu_cpus = max(1, res.get("train", {}).get("num_cpus", 1)) * gpus
    group = lambda name, n, c: {"groupName": name, "replicas": n, "minReplicas": n, "maxReplicas": n,  # noqa: E731
                                "rayStartParams": {}, "template": pod([c])}
    submitter = {"name": "ray-job-submitter", "image": image, "resources": resources("500m", "1Gi"),
                 "securityContext": container_security()}  # KubeRay supplies its `ray job submit` command
    return {"apiVersion": "ray.io/v1", "kind": "RayJob", "metadata": {"name": "attnzoo-repro"}, "spec": {
        "entrypoint": " && ".join(ray_steps()), "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 600, "backoffLimit": 0,
        "submitterPodTemplate": {"spec": {"securityContext": pod_security(), "restartPolicy": "Never",
                                          "containers": [submitter]}},
        "rayClusterSpec": {
            "rayVersion": RAY_VERSION, "authOptions": {"mode": "token", "secretName": SECRET},
            "headGroupSpec": {"rayStartParams": {"num-cpus": "0"},
                              "template": pod([ray_container("ray-head", image, 2, "8Gi")])},
            "workerGroupSpecs": [group("cpu", workers, ray_container("ray-worker", image, cpus, memory)),
                                 group("gpu", gpu_workers, ray_container("ray-worker", gpu_image, gpu_cpus or 1,
                                                                         memory, max(gpus, 1)))]}}}


def pytorchjob(entry: str, nodes: int, image: str, cpus: int, gpus: int, memory: str) -> dict:
    """Training Operator PyTorchJob: N Worker pods, each running train@ENTRY's command with ATTNZOO_LAUNCHER
    set to torchrun, which takes its node count, processes per node and c10d rendezvous (on worker 0's
    pytorchjob-port) from the PET_* variables the operator sets from elasticPolicy and nprocPerNode."""
    container = {"name": "pytorch", "image": image, "workingDir": CHECKOUT,
                 "command": ["python", "-m", "pipeline.stages.train", entry],
                 "env": [{"name": "ATTNZOO_LAUNCHER", "value": "torchrun"}, *common_env()],
                 "ports": [{"name": "pytorchjob-port", "containerPort": RDZV_PORT, "protocol": "TCP"}],
                 "volumeMounts": [workspace_volume()[1], {"name": "dshm", "mountPath": "/dev/shm"}],
                 "resources": resources(cpus, memory, gpus), "securityContext": container_security()}
    shm = {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}  # NCCL and DataLoader workers
    return {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob",
            "metadata": {"name": f"attnzoo-train-{entry.replace('_', '-')}"}, "spec": {
                "nprocPerNode": str(gpus or 1),
                "elasticPolicy": {"rdzvBackend": "c10d", "minReplicas": nodes, "maxReplicas": nodes, "maxRestarts": 3},
                "runPolicy": {"backoffLimit": 3, "cleanPodPolicy": "None"},
                "pytorchReplicaSpecs": {"Worker": {"replicas": nodes, "restartPolicy": "OnFailure",
                                                   "template": pod([container], volumes=[shm])}}}}


FILES = ("workspace.yaml", "rayjob.yaml", "pytorchjob.yaml")
HEADER = ("# Generated by deploy/training/generate.py with {args}; change the generator's options or code, not this\n"
          "# file (docs/cluster.md, Kubernetes). Pod Security: \"restricted\" (tests/test_deploy_training.py).\n")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description="Write the Kubernetes manifests that train attnzoo on a cluster.")
    ap.add_argument("--entry", default="bahdanau",
                    help="the params.yaml entry the PyTorchJob trains (default %(default)s)")
    ap.add_argument("--nodes", type=int, default=2,
                    help="PyTorchJob nodes (pods), one rendezvous (default %(default)s)")
    ap.add_argument("--image", default=IMAGE, help="image with requirements.lock's environment (default %(default)s)")
    ap.add_argument("--gpu-image", default=f"{IMAGE}-cuda",
                    help="image with requirements-gpu.lock's environment, for GPU pods (default %(default)s)")
    ap.add_argument("--gpus-per-node", type=int, default=0,
                    help="GPUs per PyTorchJob pod (0: CPU training) and per GPU Ray worker (at least 1); "
                         "default %(default)s")
    ap.add_argument("--cpus-per-node", type=int, default=4, help="CPUs per pod (default %(default)s)")
    ap.add_argument("--memory", default="16Gi", help="memory per pod (default %(default)s)")
    ap.add_argument("--ray-workers", type=int, default=2, help="CPU Ray worker pods (default %(default)s)")
    ap.add_argument("--gpu-workers", type=int, default=0, help="GPU Ray worker pods (default %(default)s)")
    ap.add_argument("--repository", default="https://git.example.com/attnzoo.git",
                    help="git URL the workspace Job checks out (default %(default)s)")
    ap.add_argument("--revision", default="main", help="branch, tag or commit to check out (default %(default)s)")
    ap.add_argument("--storage", default="100Gi", help="size of the workspace PVC (default %(default)s)")
    ap.add_argument("--out", type=Path, help=f"write {', '.join(FILES)} into DIR (default: all to stdout)")
    return ap


def documents(args: argparse.Namespace) -> dict[str, list[dict]]:
    """The objects of each file, for these options."""
    if args.entry not in yaml.safe_load((ROOT / "params.yaml").read_text())["models"]:
        raise SystemExit(f"error: --entry {args.entry}: no such entry in params.yaml (`attnzoo list` shows them)")
    if args.nodes < 1 or min(args.ray_workers, args.gpu_workers, args.gpus_per_node) < 0:
        raise SystemExit("error: --nodes must be at least 1, worker and GPU counts at least 0")
    train_image = args.gpu_image if args.gpus_per_node else args.image
    return {"workspace.yaml": workspace(args.image, args.repository, args.revision, args.storage),
            "rayjob.yaml": [rayjob(args.image, args.gpu_image, args.ray_workers, args.gpu_workers,
                                   args.cpus_per_node, args.gpus_per_node, args.memory)],
            "pytorchjob.yaml": [pytorchjob(args.entry, args.nodes, train_image, args.cpus_per_node,
                                           args.gpus_per_node, args.memory)]}


def render(docs: list[dict], argv: list[str]) -> str:
    options = " ".join(argv) if argv else "its default options"
    return HEADER.format(args=options) + yaml.safe_dump_all(docs, sort_keys=False, width=120)


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    shown, skip = [], False  # the options the files record in their header: all but --out DIR
    for arg in argv:
        if not skip and not arg.startswith("--out"):
            shown.append(arg)
        skip = arg == "--out"
    files = documents(args)
    if args.out is None:
        sys.stdout.write(render([d for docs in files.values() for d in docs], shown))
        return
    args.out.mkdir(parents=True, exist_ok=True)
    for name, docs in files.items():
        (args.out / name).write_text(render(docs, shown))


if __name__ == "__main__":
    main()
