"""tests/pod_security.py, the "restricted" Pod Security Standard the deploy/ manifests are held to: a
compliant pod passes, and one violation of each control (the admission's own examples) is caught by that
control alone."""

from __future__ import annotations

import copy

import pytest

from tests import pod_security

SAFE = {"runAsNonRoot": True, "allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"}}


def pod() -> dict:
    """A pod that passes "restricted": what each case below then breaks in one place."""
    return {"securityContext": {"runAsUser": 10001},
            "initContainers": [{"name": "init", "securityContext": copy.deepcopy(SAFE)}],
            "containers": [{"name": "main", "securityContext": copy.deepcopy(SAFE), "ports": [{"containerPort": 8080}],
                            "readinessProbe": {"httpGet": {"path": "/", "port": 8080}}}],
            "volumes": [{"name": "tmp", "emptyDir": {}}, {"name": "data", "persistentVolumeClaim": {"claimName": "x"}},
                        {"name": "token", "secret": {"secretName": "s"}}]}


def main(spec: dict) -> dict:
    return spec["containers"][0]["securityContext"]


CASES = {  # control: how a pod breaks it
    "HostProcess": lambda m, s: s["securityContext"].update(windowsOptions={"hostProcess": True}),
    "Host Namespaces": lambda m, s: s.update(hostPID=True),
    "Privileged Containers": lambda m, s: main(s).update(privileged=True),
    "HostPath Volumes / Volume Types": lambda m, s: s["volumes"].append({"name": "h", "hostPath": {"path": "/"}}),
    "Host Ports": lambda m, s: s["containers"][0]["ports"][0].update(hostPort=8080),
    "Host Probes / Lifecycle Hooks": lambda m, s: s["containers"][0]["readinessProbe"]["httpGet"].update(
        host="10.0.0.1"),
    "AppArmor": lambda m, s: m.update(annotations={"container.apparmor.security.beta.kubernetes.io/main":
                                                   "unconfined"}),
    "SELinux": lambda m, s: main(s).update(seLinuxOptions={"user": "system_u"}),
    "/proc Mount Type": lambda m, s: main(s).update(procMount="Unmasked"),
    "Sysctls": lambda m, s: s["securityContext"].update(sysctls=[{"name": "kernel.msgmax", "value": "1"}]),
    "Privilege Escalation": lambda m, s: s["initContainers"][0]["securityContext"].pop("allowPrivilegeEscalation"),
    "Running as Non-root": lambda m, s: main(s).update(runAsNonRoot=False),
    "Running as Non-root user": lambda m, s: s["securityContext"].update(runAsUser=0),
    "Seccomp": lambda m, s: main(s).update(seccompProfile={"type": "Unconfined"}),
    "Capabilities": lambda m, s: main(s)["capabilities"].update(add=["NET_RAW"]),
}


def test_a_restricted_pod_passes_every_control():
    assert pod_security.violations({}, pod()) == []


def test_every_control_has_a_case():
    assert set(CASES) == set(pod_security.CHECKS)


@pytest.mark.parametrize("control", CASES)
def test_each_control_catches_its_violation(control):
    meta, spec = {}, pod()
    CASES[control](meta, spec)
    found = pod_security.violations(meta, spec)
    assert found and all(v.startswith(f"{control}: ") for v in found), found


@pytest.mark.parametrize("edit,control", [
    # seccomp and runAsNonRoot may be set once on the pod instead of on every container
    (lambda s: [c["securityContext"].pop("seccompProfile") for c in s["initContainers"] + s["containers"]], "Seccomp"),
    (lambda s: [c["securityContext"].pop("runAsNonRoot") for c in s["initContainers"] + s["containers"]],
     "Running as Non-root"),
    (lambda s: s["volumes"].append({"name": "nfs", "nfs": {"server": "x", "path": "/"}}),
     "HostPath Volumes / Volume Types"),
    (lambda s: s["containers"][0]["securityContext"].pop("capabilities"), "Capabilities"),
    (lambda s: s.update(ephemeralContainers=[{"name": "debug"}]), "Privilege Escalation"),
])
def test_unset_fields_and_other_containers(edit, control):
    spec = pod()
    edit(spec)
    found = pod_security.violations({}, spec)
    assert any(v.startswith(f"{control}: ") for v in found), found
    if control in ("Seccomp", "Running as Non-root"):  # the pod-level setting covers the containers
        fixed = copy.deepcopy(spec)
        fixed["securityContext"].update(seccompProfile={"type": "RuntimeDefault"}, runAsNonRoot=True)
        assert pod_security.violations({}, fixed) == []


def test_exemptions_of_the_reference_checks():
    """Windows pods skip privilege escalation, seccomp and capabilities; hostUsers: false pods (their own
    user namespace) skip runAsNonRoot and runAsUser, but not procMount in restricted."""
    spec = pod()
    for c in spec["initContainers"] + spec["containers"]:
        c["securityContext"] = {"runAsNonRoot": True}
    assert {v.split(":")[0] for v in pod_security.violations({}, spec)} == {
        "Privilege Escalation", "Seccomp", "Capabilities"}
    spec["os"] = {"name": "windows"}
    assert pod_security.violations({}, spec) == []
    spec = pod()
    spec.update(hostUsers=False)
    spec["securityContext"]["runAsUser"] = 0
    main(spec).update(runAsNonRoot=False, procMount="Unmasked")
    assert [v.split(":")[0] for v in pod_security.violations({}, spec)] == ["/proc Mount Type"]
