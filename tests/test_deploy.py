"""deploy/: Prometheus rules (promtool), Grafana dashboards, docker compose, Dockerfile and
Kubernetes manifests, validated without a cluster or a Docker daemon."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from stream_app.metrics import METRIC_NAMES
from trainsentry.config import ENV_VARS, Secret, Settings

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
RULES = DEPLOY / "prometheus" / "trainsentry.rules.yml"
OPERATIONS = ROOT / "docs" / "operations.md"

#: DOMAIN.md's predictive signs and the service's own health, one alert each at least.
REQUIRED_ALERTS = {
    "VerlGradNormUnstable", "VerlLearningRateDrift", "VerlCommEfficiencyDecay",
    "VerlStepTimeP95High", "VerlActorGpuMemoryHigh", "VerlRolloutSuccessLow", "VerlKlOutOfRange",
    "TrainsentryConsumerLagHigh", "TrainsentryDeadLettersIncreasing",
    "TrainsentryWebhookFailures", "TrainsentryWebhookConfigError", "TrainsentryNoEvents",
    "TrainsentryDown", "TrainsentryCommandsRejected",
}
_SUFFIXES = ("_bucket", "_sum", "_count")


def _promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        why = "promtool is missing (Debian: apt-get install prometheus; scripts/setup.sh does it)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(why)
        pytest.skip(why)
    return path


def _rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text())
    return [r for g in doc["groups"] for r in g["rules"]]


def _metric_names(expr: str) -> set[str]:
    """Our metric names an expression refers to (verl_*, trainsentry_*, recording rules)."""
    names = set(re.findall(r"\b((?:verl_|trainsentry_|trainsentry:)[A-Za-z0-9_:]+)", expr))
    out = set()
    for n in names:
        for suffix in _SUFFIXES:
            if n.endswith(suffix) and n[: -len(suffix)] in METRIC_NAMES:
                n = n[: -len(suffix)]
        out.add(n)
    return out


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors of a markdown text."""
    out = set()
    for line in markdown.splitlines():
        m = re.match(r"#+\s+(.*)", line)
        if m:
            slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            out.add(slug)
    return out


# ------------------------------------------------------------------------------ Prometheus

def test_promtool_accepts_the_rules() -> None:
    """`promtool check rules` passes (fails, not skips, in CI when promtool is missing)."""
    promtool = _promtool()
    done = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True,
                          text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_rule_unit_tests_pass() -> None:
    """The alert rules fire on the series they are meant for (`promtool test rules`)."""
    promtool = _promtool()
    tests = sorted((DEPLOY / "prometheus" / "tests").glob("*.yml"))
    assert tests
    done = subprocess.run([promtool, "test", "rules", *map(str, tests)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def test_promtool_accepts_the_prometheus_config() -> None:
    """deploy/prometheus/prometheus.yml parses (rule file path aside: it is the container's)."""
    promtool = _promtool()
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    cfg["rule_files"] = [str(RULES)]
    tmp = DEPLOY.parent / "artifacts" / "prometheus-check.yml"
    tmp.parent.mkdir(exist_ok=True)
    tmp.write_text(yaml.safe_dump(cfg))
    done = subprocess.run([promtool, "check", "config", "--syntax-only", str(tmp)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr


def test_rules_cover_the_predictive_signs_and_service_health() -> None:
    """Every predictive sign of DOMAIN.md and every service-health concern has an alert."""
    alerts = {r["alert"] for r in _rules() if "alert" in r}
    assert alerts >= REQUIRED_ALERTS, REQUIRED_ALERTS - alerts


def test_rules_use_only_metrics_the_service_exports() -> None:
    """No typo'd metric: every verl_/trainsentry_ name is exported or a recording rule."""
    recorded = {r["record"] for r in _rules() if "record" in r}
    for rule in _rules():
        unknown = _metric_names(rule["expr"]) - METRIC_NAMES - recorded
        assert not unknown, (rule.get("alert") or rule.get("record"), unknown)


def test_every_alert_has_severity_summary_and_a_runbook_in_operations_md() -> None:
    """Labels and annotations operators rely on; runbook anchors exist in docs/operations.md."""
    anchors = _anchors(OPERATIONS.read_text())
    for rule in _rules():
        if "alert" not in rule:
            continue
        assert rule["labels"]["severity"] in ("info", "warning", "critical"), rule["alert"]
        ann = rule["annotations"]
        assert ann.get("summary") and ann.get("description"), rule["alert"]
        path, _, anchor = ann["runbook_url"].partition("#")
        assert path == "docs/operations.md" and anchor in anchors, (rule["alert"], anchor)


# ------------------------------------------------------------------------------ Grafana

_PANEL_SCHEMA = {
    "type": "object",
    "required": ["id", "type", "title", "gridPos", "targets", "datasource"],
    "properties": {
        "id": {"type": "integer"},
        "type": {"enum": ["timeseries", "stat", "table", "gauge", "bargauge", "text"]},
        "title": {"type": "string", "minLength": 1},
        "gridPos": {"type": "object", "required": ["x", "y", "w", "h"],
                    "properties": {k: {"type": "integer", "minimum": 0} for k in "xywh"}},
        "targets": {"type": "array", "minItems": 1, "items": {
            "type": "object", "required": ["refId", "expr"],
            "properties": {"expr": {"type": "string", "minLength": 1}}}},
    },
}
_DASHBOARD_SCHEMA = {
    "type": "object",
    "required": ["uid", "title", "schemaVersion", "panels", "templating", "time"],
    "properties": {"uid": {"type": "string", "pattern": "^[a-z0-9-]{1,40}$"},
                   "schemaVersion": {"type": "integer", "minimum": 30},
                   "panels": {"type": "array", "minItems": 4, "items": _PANEL_SCHEMA}},
}


@pytest.mark.parametrize("path", sorted((DEPLOY / "grafana" / "dashboards").glob("*.json")),
                         ids=lambda p: p.name)
def test_grafana_dashboard_is_well_formed_and_queries_known_metrics(path: Path) -> None:
    """Valid JSON, the dashboard/panel structure Grafana needs, unique ids, no panel overlap,
    and every query names a metric the service exports (or a recording rule)."""
    dash = json.loads(path.read_text())
    jsonschema.validate(dash, _DASHBOARD_SCHEMA)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"panel {p['title']!r} overlaps another"
        cells |= mine
    recorded = {r["record"] for r in _rules() if "record" in r}
    for p in dash["panels"]:
        for t in p["targets"]:
            unknown = _metric_names(t["expr"]) - METRIC_NAMES - recorded
            assert not unknown, (path.name, p["title"], unknown)


def test_grafana_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    """The provider path is where compose mounts the dashboards; the datasource uid matches."""
    prov = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/trainsentry.yml").read_text())
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    mounts = compose["services"]["grafana"]["volumes"]
    assert any(m.endswith(":" + prov["providers"][0]["options"]["path"] + ":ro") for m in mounts)
    uid = ds["datasources"][0]["uid"]
    for path in (DEPLOY / "grafana" / "dashboards").glob("*.json"):
        for p in json.loads(path.read_text())["panels"]:
            assert p["datasource"]["uid"] == uid


# ------------------------------------------------------------------------------ compose, image

def test_compose_runs_kafka_kraft_workers_prometheus_and_grafana() -> None:
    """Services, KRaft settings, scalable workers with known env vars, mounted files exist."""
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    svcs = compose["services"]
    assert {"kafka", "trainsentry", "prometheus", "grafana"} <= set(svcs)
    kafka = svcs["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"
    worker = svcs["trainsentry"]
    assert (DEPLOY.parent / worker["build"]["context"].replace("..", ".") /
            worker["build"]["dockerfile"]).exists() or (ROOT / worker["build"]["dockerfile"]).exists()
    assert worker["deploy"]["replicas"] >= 2 and "ports" not in worker  # scalable: no host port
    for name in ("trainsentry", "dashboard"):
        env = svcs[name]["environment"]
        assert set(env) <= set(ENV_VARS), set(env) - set(ENV_VARS)
        assert env["TRAINSENTRY_WEB_HOST"] == "0.0.0.0"
        assert svcs[name]["restart"] == "unless-stopped"  # exit 70 relies on a restart
    # The dashboard is a worker of the same group: it must run on the same settings.
    assert svcs["dashboard"]["environment"] == svcs["trainsentry"]["environment"]
    for name in ("prometheus", "grafana"):
        for mount in svcs[name]["volumes"]:
            src = mount.split(":")[0]
            if src.startswith("./"):
                assert (DEPLOY / src).exists(), mount
    prom = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in prom["scrape_configs"] if j["job_name"] == "trainsentry")
    assert job["dns_sd_configs"][0]["names"] == ["trainsentry"]


def test_dockerfile_copies_existing_sources_and_serves_on_6066() -> None:
    """COPY sources exist; the image runs `trainsentry serve` on 0.0.0.0:6066 as non-root."""
    text = (DEPLOY / "Dockerfile").read_text()
    for src in re.findall(r"^COPY (?!--from)(.+?) \S+$", text, flags=re.M):
        for part in src.split():
            assert (ROOT / part).exists(), part
    assert "EXPOSE 6066" in text and 'CMD ["serve"]' in text and "USER 10001" in text
    assert "TRAINSENTRY_WEB_HOST=0.0.0.0" in text


def test_dashboard_assets_ship_in_the_package() -> None:
    """The image installs a wheel: the dashboard files must be package data."""
    import tomllib

    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    data = meta["tool"]["setuptools"]["package-data"]
    assert "dashboard/*" in data.get("stream_app", [])
    for name in ("index.html", "app.js", "style.css"):
        assert (ROOT / "stream_app" / "dashboard" / name).is_file()


# ------------------------------------------------------------------------------ Kubernetes

_META = {"type": "object", "required": ["name", "namespace"],
         "properties": {"name": {"type": "string", "pattern": "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"},
                        "namespace": {"const": "trainsentry"}}}
_LABELS = {"type": "object", "additionalProperties": {"type": "string"}, "minProperties": 1}
_PROBE = {"type": "object", "required": ["httpGet"],
          "properties": {"httpGet": {"type": "object", "required": ["path", "port"]}}}
_RESOURCES = {"type": "object", "required": ["requests", "limits"],
              "properties": {k: {"type": "object", "required": ["cpu", "memory"]}
                             for k in ("requests", "limits")}}
_CONTAINER = {"type": "object",
              "required": ["name", "image", "ports", "resources", "livenessProbe",
                           "readinessProbe", "envFrom"],
              "properties": {"resources": _RESOURCES, "livenessProbe": _PROBE,
                             "readinessProbe": _PROBE,
                             "ports": {"type": "array", "minItems": 1, "items": {
                                 "type": "object", "required": ["containerPort"]}}}}
SCHEMAS: dict[str, dict[str, Any]] = {
    "Namespace": {"type": "object", "required": ["metadata"],
                  "properties": {"metadata": {"type": "object", "required": ["name"]}}},
    "ConfigMap": {"type": "object", "required": ["metadata", "data"],
                  "properties": {"metadata": _META, "data": {
                      "type": "object", "additionalProperties": {"type": "string"}}}},
    "Secret": {"type": "object", "required": ["metadata", "type", "stringData"],
               "properties": {"metadata": _META, "stringData": {
                   "type": "object", "additionalProperties": {"type": "string"}}}},
    "Deployment": {"type": "object", "required": ["metadata", "spec"], "properties": {
        "metadata": _META,
        "spec": {"type": "object", "required": ["replicas", "selector", "template"],
                 "properties": {
                     "replicas": {"type": "integer", "minimum": 2},
                     "selector": {"type": "object", "required": ["matchLabels"],
                                  "properties": {"matchLabels": _LABELS}},
                     "template": {"type": "object", "required": ["metadata", "spec"],
                                  "properties": {
                                      "metadata": {"type": "object", "required": ["labels"],
                                                   "properties": {"labels": _LABELS}},
                                      "spec": {"type": "object", "required": ["containers"],
                                               "properties": {"containers": {
                                                   "type": "array", "minItems": 1,
                                                   "items": _CONTAINER}}}}}}}}},
    "Service": {"type": "object", "required": ["metadata", "spec"], "properties": {
        "metadata": _META,
        "spec": {"type": "object", "required": ["selector", "ports"],
                 "properties": {"selector": _LABELS, "ports": {
                     "type": "array", "minItems": 1,
                     "items": {"type": "object", "required": ["port", "targetPort"]}}}}}},
    "PodDisruptionBudget": {"type": "object", "required": ["metadata", "spec"], "properties": {
        "metadata": _META,
        "spec": {"type": "object", "required": ["selector"],
                 "oneOf": [{"required": ["maxUnavailable"]}, {"required": ["minAvailable"]}],
                 "properties": {"selector": {"type": "object", "required": ["matchLabels"]}}}}},
}
API_VERSIONS = {"Namespace": "v1", "ConfigMap": "v1", "Secret": "v1", "Service": "v1",
                "Deployment": "apps/v1", "PodDisruptionBudget": "policy/v1"}


def _manifests() -> list[dict[str, Any]]:
    docs: list[dict[str, Any]] = []
    for path in sorted((DEPLOY / "k8s").glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs += [d for d in yaml.safe_load_all(path.read_text()) if d]
    return docs


def _by_kind(kind: str) -> list[dict[str, Any]]:
    return [d for d in _manifests() if d["kind"] == kind]


def test_every_manifest_matches_its_kind_schema() -> None:
    """Each document: known kind, right apiVersion, required fields per kind."""
    docs = _manifests()
    assert {d["kind"] for d in docs} >= {"Deployment", "Service", "ConfigMap", "Secret",
                                          "PodDisruptionBudget"}
    for d in docs:
        assert d["kind"] in SCHEMAS, d["kind"]
        assert d["apiVersion"] == API_VERSIONS[d["kind"]], d["kind"]
        jsonschema.validate(d, SCHEMAS[d["kind"]])


def test_kustomization_lists_every_manifest_file() -> None:
    """kubectl apply -k applies all of deploy/k8s."""
    kust = yaml.safe_load((DEPLOY / "k8s" / "kustomization.yaml").read_text())
    files = {p.name for p in (DEPLOY / "k8s").glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kust["resources"]) == files


def test_deployment_probes_ports_and_selectors_agree() -> None:
    """Probes hit /healthz and /readyz on the web port; Service and PDB select the pods;
    envFrom names the ConfigMap and Secret that exist."""
    (dep,) = _by_kind("Deployment")
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    (cm,) = _by_kind("ConfigMap")
    assert ports["http"] == int(cm["data"]["TRAINSENTRY_WEB_PORT"])
    assert c["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    refs = {(next(iter(e)), e[next(iter(e))]["name"]) for e in c["envFrom"]}
    names = {(d["kind"], d["metadata"]["name"]) for d in _manifests()}
    assert ("ConfigMap", "trainsentry") in names and ("Secret", "trainsentry") in names
    assert refs == {("configMapRef", "trainsentry"), ("secretRef", "trainsentry")}
    for other in _by_kind("Service") + _by_kind("PodDisruptionBudget"):
        sel = other["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        assert sel.items() <= pod_labels.items(), other["kind"]
    assert dep["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > 15


def test_configmap_and_secret_hold_known_settings_with_secrets_only_in_the_secret() -> None:
    """Keys are TRAINSENTRY_* settings; secret-typed settings never sit in the ConfigMap;
    SASL/SSL settings are present for secured clusters."""
    defaults = Settings()
    secret_vars = {var for var, name in ENV_VARS.items()
                   if isinstance(getattr(defaults, name), Secret)}
    (cm,) = _by_kind("ConfigMap")
    assert set(cm["data"]) <= set(ENV_VARS), set(cm["data"]) - set(ENV_VARS)
    assert not set(cm["data"]) & secret_vars
    assert {"TRAINSENTRY_KAFKA_SECURITY_PROTOCOL", "TRAINSENTRY_KAFKA_SASL_MECHANISM",
            "TRAINSENTRY_KAFKA_SSL_CAFILE"} <= set(cm["data"])
    secret = next(s for s in _by_kind("Secret") if s["metadata"]["name"] == "trainsentry")
    assert set(secret["stringData"]) <= secret_vars
    assert {"TRAINSENTRY_CONTROL_SECRET", "TRAINSENTRY_KAFKA_SASL_PASSWORD"} <= set(secret["stringData"])
    (dep,) = _by_kind("Deployment")
    mounts = {m["mountPath"] for m in dep["spec"]["template"]["spec"]["containers"][0]["volumeMounts"]}
    assert str(Path(cm["data"]["TRAINSENTRY_KAFKA_SSL_CAFILE"]).parent) in mounts


def test_wheel_carries_the_compiled_detector(tmp_path: Path) -> None:
    """The image installs a wheel: it must be a platform wheel holding detectors/_bestc."""
    import subprocess
    import sys
    import zipfile

    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                          "-q", "-w", str(tmp_path), str(ROOT)],
                         capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr[-2000:]
    wheels = list(tmp_path.glob("trainsentry-*.whl"))
    assert len(wheels) == 1 and "-cp311-" in wheels[0].name, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert any(n.startswith("detectors/_bestc") and n.endswith(".so") for n in names), names
    assert "detectors/best.py" in names and "stream_app/dashboard/index.html" in names
