"""Kubernetes' Pod Security Standards, "restricted" level at version "latest" (Kubernetes v1.36), for the pods
that the deploy/ manifests make, checked without a cluster.

A port of the Pod Security admission's own checks: k8s.io/pod-security-admission v0.36.2 (commit
39b45cd167e1bd665aaeefc6e1acc1cc753259f2, `policy/check_*.go`), each at its newest version, with the
restricted checks replacing the baseline ones they override there (capabilities, seccomp, hostPath volumes,
/proc mount). Each check below names the control of
https://kubernetes.io/docs/concepts/security/pod-security-standards/ and the admission's check ID. No
third-party Python, Debian or npm package implements these levels faithfully (tests/test_pod_security.py
has the negative case of every check; deploy/README.md says what was looked at).

``violations(metadata, spec)`` takes a pod's metadata and PodSpec as plain dicts (the manifests' YAML) and
returns one sentence per failed control, empty when the pod passes "restricted".
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

VERSION = "v1.36"  # the level's version these checks are ("latest" for a v1.36 API server)

CHECKS: dict[str, Callable[[dict, dict], list[str]]] = {}


def check(control: str):
    """Register a check under its control's name (as the Pod Security Standards page lists it)."""
    def register(fn):
        CHECKS[control] = fn
        return fn
    return register


def containers(spec: dict) -> Iterator[dict]:
    """initContainers, containers and ephemeralContainers: what the admission's visitContainers visits."""
    for key in ("initContainers", "containers", "ephemeralContainers"):
        yield from spec.get(key) or []


def _ctx(obj: dict) -> dict:
    return obj.get("securityContext") or {}


def _windows(spec: dict) -> bool:
    return (spec.get("os") or {}).get("name") == "windows"


def _user_namespace(spec: dict) -> bool:
    """hostUsers: false: the pod has its own user namespace (relaxPolicyForUserNamespacePod)."""
    return spec.get("hostUsers") is False


def _names(items) -> str:
    return ", ".join(repr(c.get("name", "?")) for c in items)


# ---- baseline controls (restricted includes them) ---------------------------------------------------
@check("HostProcess")
def host_process(meta: dict, spec: dict) -> list[str]:
    """windowsHostProcess: windowsOptions.hostProcess undefined or false, on the pod and every container."""
    bad = [c for c in [{"name": "pod", **spec}, *containers(spec)]
           if (_ctx(c).get("windowsOptions") or {}).get("hostProcess") is True]
    return [f"hostProcess=true on {_names(bad)}"] if bad else []


@check("Host Namespaces")
def host_namespaces(meta: dict, spec: dict) -> list[str]:
    """hostNamespaces: hostNetwork, hostPID and hostIPC undefined or false."""
    bad = [f for f in ("hostNetwork", "hostPID", "hostIPC") if spec.get(f) is True]
    return [f"{'/'.join(bad)}=true"] if bad else []


@check("Privileged Containers")
def privileged(meta: dict, spec: dict) -> list[str]:
    """privileged: securityContext.privileged undefined or false."""
    bad = [c for c in containers(spec) if _ctx(c).get("privileged") is True]
    return [f"privileged=true on {_names(bad)}"] if bad else []


@check("HostPath Volumes / Volume Types")
def volume_types(meta: dict, spec: dict) -> list[str]:
    """restrictedVolumes (overrides hostPathVolumes): only configMap, csi, downwardAPI, emptyDir, ephemeral,
    image, persistentVolumeClaim, projected and secret volumes."""
    allowed = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "image", "persistentVolumeClaim",
               "projected", "secret"}
    bad = [v.get("name", "?") for v in spec.get("volumes") or [] if not (set(v) - {"name"}) & allowed]
    return [f"volumes {bad} are not of an allowed type"] if bad else []


@check("Host Ports")
def host_ports(meta: dict, spec: dict) -> list[str]:
    """hostPorts: ports[*].hostPort undefined or 0."""
    bad = [c for c in containers(spec) if any(p.get("hostPort") for p in c.get("ports") or [])]
    return [f"hostPort on {_names(bad)}"] if bad else []


@check("Host Probes / Lifecycle Hooks")
def host_probes(meta: dict, spec: dict) -> list[str]:
    """hostProbesAndHostLifecycle (v1.34+): the httpGet/tcpSocket `host` of every probe and lifecycle
    handler undefined or empty."""
    bad = []
    for c in containers(spec):
        handlers = [c.get(p) or {} for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        handlers += [h or {} for h in (c.get("lifecycle") or {}).values()]
        if any((h.get(kind) or {}).get("host") for h in handlers for kind in ("httpGet", "tcpSocket")):
            bad.append(c)
    return [f"probe or lifecycle host set on {_names(bad)}"] if bad else []


@check("AppArmor")
def apparmor(meta: dict, spec: dict) -> list[str]:
    """appArmorProfile: appArmorProfile.type RuntimeDefault, Localhost or undefined (pod and containers);
    container.apparmor.security.beta.kubernetes.io/* annotations runtime/default, localhost/* or empty."""
    bad = [c for c in [{"name": "pod", **spec}, *containers(spec)]
           if "appArmorProfile" in _ctx(c) and _ctx(c)["appArmorProfile"].get("type") not in ("RuntimeDefault",
                                                                                            "Localhost")]
    notes = [k for k, v in (meta.get("annotations") or {}).items()
             if k.startswith("container.apparmor.security.beta.kubernetes.io/")
             and not (v == "" or v == "runtime/default" or v.startswith("localhost/"))]
    return [f"AppArmor profile not allowed on {_names(bad)} {notes}".rstrip(" []")] if bad or notes else []


@check("SELinux")
def selinux(meta: dict, spec: dict) -> list[str]:
    """seLinuxOptions (v1.31+): type empty, container_t, container_init_t, container_kvm_t or
    container_engine_t; user and role unset (pod and containers)."""
    types = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
    bad = [c for c in [{"name": "pod", **spec}, *containers(spec)] if (o := _ctx(c).get("seLinuxOptions"))
           and (o.get("type", "") not in types or o.get("user") or o.get("role"))]
    return [f"seLinuxOptions not allowed on {_names(bad)}"] if bad else []


@check("/proc Mount Type")
def proc_mount(meta: dict, spec: dict) -> list[str]:
    """procMount_restricted (v1.35, overrides procMount, so even with hostUsers: false): procMount
    undefined or Default."""
    bad = [c for c in containers(spec) if _ctx(c).get("procMount") not in (None, "Default")]
    return [f"procMount not Default on {_names(bad)}"] if bad else []


@check("Sysctls")
def sysctls(meta: dict, spec: dict) -> list[str]:
    """sysctls (v1.32+): only the safe, namespaced set."""
    safe = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies",
            "net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports",
            "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
            "net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"}
    bad = [s.get("name") for s in _ctx(spec).get("sysctls") or [] if s.get("name") not in safe]
    return [f"sysctls {bad} not allowed"] if bad else []


# ---- restricted controls ------------------------------------------------------------------------------
@check("Privilege Escalation")
def privilege_escalation(meta: dict, spec: dict) -> list[str]:
    """allowPrivilegeEscalation (v1.25+): explicitly false on every container (Windows pods exempt)."""
    if _windows(spec):
        return []
    bad = [c for c in containers(spec) if _ctx(c).get("allowPrivilegeEscalation") is not False]
    return [f"allowPrivilegeEscalation is not false on {_names(bad)}"] if bad else []


@check("Running as Non-root")
def run_as_non_root(meta: dict, spec: dict) -> list[str]:
    """runAsNonRoot (v1.35): true on the pod, or on every container; no container false (hostUsers: false
    pods exempt)."""
    if _user_namespace(spec):
        return []
    pod = _ctx(spec).get("runAsNonRoot")
    explicit = [c for c in containers(spec) if _ctx(c).get("runAsNonRoot") is False]
    implicit = [c for c in containers(spec) if _ctx(c).get("runAsNonRoot") is None and pod is not True]
    if pod is False or explicit or implicit:
        return [f"runAsNonRoot is not true for {'the pod' if pod is False else _names(explicit + implicit)}"]
    return []


@check("Running as Non-root user")
def run_as_user(meta: dict, spec: dict) -> list[str]:
    """runAsUser (v1.35): not 0 on the pod or a container (hostUsers: false pods exempt)."""
    if _user_namespace(spec):
        return []
    bad = [c for c in [{"name": "pod", **spec}, *containers(spec)] if _ctx(c).get("runAsUser") == 0]
    return [f"runAsUser=0 on {_names(bad)}"] if bad else []


@check("Seccomp")
def seccomp(meta: dict, spec: dict) -> list[str]:
    """seccompProfile_restricted (v1.25+, overrides the baseline one): seccompProfile.type RuntimeDefault or
    Localhost on the pod, or on every container, and no container Unconfined (Windows pods exempt)."""
    if _windows(spec):
        return []
    allowed = ("RuntimeDefault", "Localhost")
    pod = _ctx(spec).get("seccompProfile")
    bad = [c for c in containers(spec) if (p := _ctx(c).get("seccompProfile")) and p.get("type") not in allowed]
    unset = [c for c in containers(spec) if not _ctx(c).get("seccompProfile") and not pod]
    if (pod and pod.get("type") not in allowed) or bad or unset:
        return [f"seccompProfile.type is not RuntimeDefault/Localhost for {_names(bad + unset) or 'the pod'}"]
    return []


@check("Capabilities")
def capabilities(meta: dict, spec: dict) -> list[str]:
    """capabilities_restricted (v1.25+, overrides the baseline one): drop includes ALL, add only
    NET_BIND_SERVICE (Windows pods exempt)."""
    if _windows(spec):
        return []
    caps = [(c, _ctx(c).get("capabilities") or {}) for c in containers(spec)]
    missing = [c for c, cap in caps if "ALL" not in (cap.get("drop") or [])]
    added = [c for c, cap in caps if set(cap.get("add") or []) - {"NET_BIND_SERVICE"}]
    out = [f'capabilities.drop does not include "ALL" on {_names(missing)}'] if missing else []
    return out + ([f"capabilities.add beyond NET_BIND_SERVICE on {_names(added)}"] if added else [])


def violations(metadata: dict, spec: dict) -> list[str]:
    """Every failed "restricted" control of one pod, as `control: what`."""
    return [f"{control}: {msg}" for control, fn in CHECKS.items() for msg in fn(metadata or {}, spec)]
