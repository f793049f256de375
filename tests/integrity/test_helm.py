"""deploy/helm/values.yaml and the Dockerfile, statically (no cluster, no Docker engine here): the
values fit the official Airflow chart's values.schema.json, run the project image with the DAGs
baked in, take every credential from a Secret, and the image puts dags/ and plugins/ where Airflow
(and the chart's pods) read them.

The chart's schema is not vendored (it is not this project's file): CHART_SCHEMA below transcribes,
from apache/airflow `chart/values.schema.json` at commit 002e5532 (the chart on main whose defaults
are Airflow 3.0.5), the keys and types of every subtree the values file sets, with the chart's own
`additionalProperties: false` where the chart has it, so a misspelt or misplaced key fails here.
With DFLASH_AIRFLOW_CHART_SCHEMA pointing at the schema of the chart you install (`helm pull
apache-airflow/airflow --version X --untar`, then `airflow/values.schema.json`), the values are also
validated against all of it.
"""

from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
VALUES = REPO / "deploy/helm/values.yaml"
DOCKERFILE = REPO / "Dockerfile"

_ANY: dict[str, Any] = {}
_STR_OR_NULL = {"type": ["string", "null"]}
_STR_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_PULL = {"type": "string", "enum": ["Always", "Never", "IfNotPresent"]}


def _closed(props: dict[str, Any], *others: str) -> dict[str, Any]:
    """An object the chart closes (`additionalProperties: false`): `props` typed, `others` named only."""
    return {"type": "object", "additionalProperties": False, "properties": {**{k: _ANY for k in others}, **props}}


_SERVICE_ACCOUNT = {"type": "object", "properties": {
    "automountServiceAccountToken": {"type": "boolean"}, "create": {"type": "boolean"},
    "name": _STR_OR_NULL, "annotations": _STR_MAP}}
_RESOURCES = _closed({"limits": {"type": "object"}, "requests": {"type": "object"}}, "claims")  # k8s ResourceRequirements

# Top-level keys of the chart (read in the schema; the root itself is open, so this list is what
# catches a misspelt top-level key).
CHART_TOP_LEVEL = {
    "fullnameOverride", "revisionHistoryLimit", "devMode", "nameOverride", "useStandardNaming", "uid", "gid",
    "airflowHome", "defaultAirflowRepository", "defaultAirflowTag", "defaultAirflowDigest", "airflowVersion",
    "securityContext", "securityContexts", "containerLifecycleHooks", "nodeSelector", "affinity", "tolerations",
    "topologySpreadConstraints", "schedulerName", "labels", "ingress", "networkPolicies", "airflowPodAnnotations",
    "airflowConfigAnnotations", "airflowLocalSettings", "rbac", "executor", "allowPodLaunching", "allowJobLaunching",
    "images", "env", "volumes", "volumeMounts", "secret", "enableBuiltInSecretEnvVars", "extraEnv", "extraEnvFrom",
    "priorityClasses", "extraSecrets", "extraConfigMaps", "data", "fernetKey", "fernetKeySecretName",
    "fernetKeySecretAnnotations", "apiSecretKey", "apiSecretAnnotations", "apiSecretKeySecretName", "jwtSecret",
    "jwtSecretName", "jwtSecretAnnotations", "webserverSecretKey", "webserverSecretAnnotations",
    "webserverSecretKeySecretName", "kerberos", "workers", "scheduler", "postgresql", "config", "multiNamespaceMode",
    "podTemplate", "dags", "logs",
}

CHART_SCHEMA: dict[str, Any] = {
    "$schema": "http://json-schema.org/draft-07/schema",
    "type": "object",
    "properties": {
        "airflowHome": {"type": "string"},
        "defaultAirflowTag": {"type": "string"},
        "airflowVersion": {"type": "string"},
        "executor": {"type": "string", "pattern": r"^(([a-zA-Z_][a-zA-Z0-9_]*.)*[A-Z][a-zA-Z0-9]+Executor)"
                                                 r"(,(([a-zA-Z_][a-zA-Z0-9_]*.)*[A-Z][a-zA-Z0-9]+Executor))*$"},
        "images": _closed(
            {"airflow": _closed({"repository": _STR_OR_NULL, "tag": _STR_OR_NULL, "digest": _STR_OR_NULL,
                                 "pullPolicy": _PULL})},
            "useDefaultImageForMigration", "migrationsWaitTimeout", "pod_template", "flower", "statsd", "redis",
            "pgbouncer", "pgbouncerExporter", "gitSync"),
        "env": {"type": "array", "items": {"type": "object", "additionalProperties": False, "required": ["name", "value"],
                                           "properties": {"name": {"type": "string"}, "value": {"type": "string"}}}},
        "secret": {"type": "array", "items": {
            "type": "object", "additionalProperties": False, "required": ["envName", "secretName"],
            "properties": {"envName": {"type": "string"}, "secretName": {"type": "string"}, "secretKey": {"type": "string"}}}},
        "extraEnv": {"type": ["null", "string"]},
        "extraEnvFrom": {"type": ["null", "string"]},
        "extraSecrets": {"type": "object", "additionalProperties": {
            "type": "object", "minProperties": 1, "additionalProperties": False,
            "properties": {"type": {"type": "string"}, "labels": _STR_MAP, "annotations": _STR_MAP,
                           "useHelmHooks": {"type": "boolean"}, "data": {"type": "string"}, "stringData": {"type": "string"}}}},
        "config": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": {"type": ["boolean", "integer", "number", "string"]}}},
        "workers": _closed(
            {"replicas": {"type": "integer"}, "resources": _RESOURCES,
             "terminationGracePeriodSeconds": {"type": "integer"}, "safeToEvict": {"type": "boolean"},
             "serviceAccount": _SERVICE_ACCOUNT,
             "celery": {"type": "object", "properties": {"serviceAccount": _SERVICE_ACCOUNT}},
             "kubernetes": {"type": "object", "properties": {"serviceAccount": _SERVICE_ACCOUNT}}},
            "revisionHistoryLimit", "command", "args", "livenessProbe", "updateStrategy", "podManagementPolicy",
            "strategy", "keda", "hpa", "persistence", "kerberosSidecar", "kerberosInitContainer", "extraContainers",
            "extraInitContainers", "extraPorts", "extraVolumes", "extraVolumeMounts", "nodeSelector", "runtimeClassName",
            "priorityClassName", "affinity", "tolerations", "topologySpreadConstraints", "hostAliases", "annotations",
            "podAnnotations", "schedulerName", "labels", "logGroomerSidecar", "securityContext",
            "containerLifecycleHooks", "securityContexts", "waitForMigrations", "env", "volumeClaimTemplates",
            "useWorkerDedicatedServiceAccounts"),
        "dags": _closed({
            "mountPath": _STR_OR_NULL,
            "persistence": _closed({"enabled": {"type": "boolean"}, "size": {"type": "string"},
                                    "storageClassName": _STR_OR_NULL,
                                    "accessMode": {"type": "string", "enum": ["ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany"]},
                                    "existingClaim": _STR_OR_NULL, "annotations": _STR_MAP, "subPath": _STR_OR_NULL}),
            "gitSync": _closed(
                {"enabled": {"type": "boolean"}},
                "repo", "branch", "rev", "ref", "depth", "maxFailures", "subPath", "wait", "period", "containerName",
                "securityContext", "livenessProbe", "readinessProbe", "emptyDirConfig", "containerLifecycleHooks",
                "securityContexts", "uid", "extraVolumeMounts", "credentialsSecret", "sshKey", "sshKeySecret",
                "knownHosts", "env", "envFrom", "resources"),
        }),
    },
}


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    return yaml.safe_load(VALUES.read_text())


def _pins() -> dict[str, str]:
    return dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))


def _copies() -> list[tuple[str, str]]:
    """(source, destination) of every COPY in the Dockerfile (flags dropped)."""
    out = []
    for line in DOCKERFILE.read_text().splitlines():
        if line.startswith("COPY "):
            args = [a for a in shlex.split(line)[1:] if not a.startswith("--")]
            out += [(src.rstrip("/"), args[-1].rstrip("/")) for src in args[:-1]]
    return out


def _airflow_default(option: str, home: str) -> str:
    """Airflow's own default for a [core] path option, from the installed Airflow's config.yml."""
    import airflow

    config = yaml.safe_load((Path(airflow.__file__).parent / "config_templates/config.yml").read_text())
    return str(config["core"]["options"][option]["default"]).replace("{AIRFLOW_HOME}", home)


def test_values_fit_the_charts_schema(values: dict[str, Any]) -> None:
    jsonschema.Draft7Validator(CHART_SCHEMA).validate(values)
    unknown = sorted(set(values) - CHART_TOP_LEVEL)
    assert not unknown, f"not top-level keys of the chart: {unknown}"


@pytest.mark.parametrize(("mutation", "error"), [
    ({"dags": {"persistance": {"enabled": False}}}, "Additional properties are not allowed"),
    ({"images": {"airflow": {"repository": "r", "tags": "x"}}}, "Additional properties are not allowed"),
    ({"executor": "Kubernetes"}, "does not match"),
    ({"config": {"core": {"parallelism": [64]}}}, "is not of type"),
    ({"workers": {"safeToEvict": "false"}}, "is not of type"),
])
def test_the_schema_check_catches_wrong_keys_and_types(values: dict[str, Any], mutation: dict[str, Any], error: str) -> None:
    with pytest.raises(jsonschema.ValidationError, match=error):
        jsonschema.Draft7Validator(CHART_SCHEMA).validate({**values, **mutation})


def test_values_fit_the_full_chart_schema_when_given(values: dict[str, Any]) -> None:
    path = os.environ.get("DFLASH_AIRFLOW_CHART_SCHEMA")
    if not path:
        pytest.skip("DFLASH_AIRFLOW_CHART_SCHEMA not set (the chart's values.schema.json, from `helm pull --untar`)")
    jsonschema.Draft7Validator(json.loads(Path(path).read_text())).validate(values)


def test_values_run_the_project_image_with_the_dags_baked_in(values: dict[str, Any]) -> None:
    airflow = _pins()["apache-airflow"]
    assert values["defaultAirflowTag"] == values["airflowVersion"] == airflow, "the chart's Airflow = the pin"
    image = values["images"]["airflow"]
    assert image["repository"].rsplit("/", 1)[-1] == "dflash-airflow", "the Dockerfile's image (as docker-compose names it)"
    assert image["tag"].startswith(f"{airflow}-py3.11"), "tagged by the Airflow pin and Python, as compose's image"
    assert f"dflash-airflow:{image['tag']}" in (REPO / "docker-compose.yaml").read_text()
    assert values["executor"] in ("KubernetesExecutor", "CeleryExecutor")
    dags = values["dags"]
    assert dags["persistence"]["enabled"] is False and dags["gitSync"]["enabled"] is False, "DAGs come from the image"
    assert dags.get("mountPath") is None, "the chart's default mount path: $AIRFLOW_HOME/dags, where the image has them"


def test_credentials_come_from_a_secret_not_the_values(values: dict[str, Any]) -> None:
    env_from = yaml.safe_load(values["extraEnvFrom"])
    assert [e["secretRef"]["name"] for e in env_from] == ["dflash-connections"]
    text = VALUES.read_text()
    assert not re.search(r"AIRFLOW_CONN_[A-Z0-9_]+\s*[:=]", text), "no connection value in the values file"
    assert not re.search(r"(?i)(password|secret_access_key|api_key)\s*:", text)
    assert values["config"]["logging"]["remote_log_conn_id"] == "aws_default"
    # The connection id the secret provides is the pipeline's default aws_conn_id.
    from dflash_pipeline.config import RunConfig

    assert RunConfig.__dataclass_fields__["aws_conn_id"].default == "aws_default"
    assert re.search(r"kubectl( -n \S+)? create secret generic dflash-connections", (REPO / "docs/scale-out.md").read_text()), \
        "docs/scale-out.md says how to create the Secret"


def test_dockerfile_puts_dags_and_plugins_where_the_charts_pods_read_them(values: dict[str, Any]) -> None:
    home = values.get("airflowHome", "/opt/airflow")  # the chart's default, = AIRFLOW_HOME of the official image
    copies = dict(_copies())
    assert copies.get("dags") == _airflow_default("dags_folder", home) == f"{home}/dags"
    assert copies.get("plugins") == _airflow_default("plugins_folder", home) == f"{home}/plugins"
    assert copies.get("include") == "/opt/dflash/include", "the package is installed from the copied sources"
    assert sorted(p.name for p in (REPO / "dags").glob("dflash_*.py")), "dags/ has the DAG files"
    assert (REPO / "plugins/dflash_progress.py").exists()
    # Both are copied after the package is installed, so a DAG edit does not redo the pip layer.
    order = [src for src, _ in _copies()]
    assert order.index("dags") > order.index("include") and order.index("plugins") > order.index("include")


def test_dockerfile_copy_parsing() -> None:
    """_copies reads flags and multi-source COPY lines as Docker does."""
    assert ("requirements.txt", "/opt/dflash") in _copies() and ("pyproject.toml", "/opt/dflash") in _copies()
