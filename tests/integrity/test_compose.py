"""docker-compose.yaml, statically (no Docker engine here): it parses, its references resolve, its
images are pinned, its Airflow settings are the ones tests/e2e/test_celery.py proves, and its
commands, ports and connections agree with the code and with the conf examples in docs/examples.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path
from typing import Any

import pytest
import yaml

from dflash_pipeline.dev.stack import CeleryConfig, PostgresDatabase

REPO = Path(__file__).resolve().parents[2]
COMPOSE = REPO / "docker-compose.yaml"
ENV_EXAMPLE = REPO / ".env.example"
CONF_EXAMPLES = {"sim": REPO / "docs/examples/conf.sim.json", "gpu": REPO / "docs/examples/conf.gpu.json"}
PROFILES = {"sim", "gpu"}
SGLANG_PORT = 30000  # SGLang's default port, the one the servers are configured with

_VAR = re.compile(r"\$(\$)|\$\{([A-Za-z_][A-Za-z0-9_]*)(?:(:?[-?])([^}]*))?\}|\$([A-Za-z_][A-Za-z0-9_]*)")


def _env_example() -> dict[str, str]:
    env: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f".env.example: not KEY=VALUE: {line!r}"
            env[key.strip()] = value.strip()
    return env


def _interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution: $$, ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?err}, $VAR."""

    def sub(m: re.Match[str]) -> str:
        if m.group(1):
            return "$"
        name = m.group(2) or m.group(5)
        op, arg = m.group(3), m.group(4)
        value = env.get(name)
        if op in (":-", "-"):
            return value if value not in (None, "") or (op == "-" and value is not None) else arg
        if op in (":?", "?"):
            assert value not in (None, ""), f"{name} required: {arg}"
            return value
        return value or ""

    return _VAR.sub(sub, text)


def _variables(text: str) -> set[str]:
    return {m.group(2) or m.group(5) for m in _VAR.finditer(text) if not m.group(1)}


@pytest.fixture(scope="module")
def raw() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """The file with .env.example's values substituted (as `docker compose config` would)."""
    return yaml.safe_load(_interpolate(COMPOSE.read_text(), _env_example()))


@pytest.fixture(scope="module")
def services(compose: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return compose["services"]


def _argv(cmd: str | list[str] | None) -> list[str]:
    if cmd is None:
        return []
    return shlex.split(cmd) if isinstance(cmd, str) else [str(c) for c in cmd]


def _airflow_services(services: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in services.items() if "AIRFLOW__CORE__EXECUTOR" in (s.get("environment") or {})}


def _by_command(services: dict[str, dict[str, Any]], command: str) -> str:
    names = [n for n, s in _airflow_services(services).items() if " ".join(_argv(s.get("command"))) == command]
    assert len(names) == 1, f"exactly one service runs `airflow {command}`: {names}"
    return names[0]


def _conf(name: str) -> dict[str, Any]:
    return json.loads(CONF_EXAMPLES[name].read_text())


# ------------------------------------------------------------------------------------------ shape


def test_compose_parses_and_has_the_production_services(services: dict[str, Any]) -> None:
    for command in ("api-server", "scheduler", "dag-processor", "triggerer", "celery worker"):
        _by_command(services, command)
    assert {"postgres", "redis", "minio", "minio-init", "airflow-init"} <= set(services)
    init = services["airflow-init"]
    assert init["environment"].get("_AIRFLOW_DB_MIGRATE") == "true", "airflow-init migrates the DB"


def test_every_reference_resolves(raw: dict[str, Any], services: dict[str, Any]) -> None:
    named_volumes = set(raw.get("volumes") or {})
    for name, svc in services.items():
        for dep in svc.get("depends_on") or {}:
            assert dep in services, f"{name} depends on unknown service {dep}"
            # A service outside a profile must not depend on one inside it (compose refuses to start).
            if not svc.get("profiles"):
                assert not services[dep].get("profiles"), f"{name} (always on) depends on profiled {dep}"
        for vol in svc.get("volumes") or []:
            source = (vol.split(":")[0] if isinstance(vol, str) else vol.get("source", ""))
            if source.startswith((".", "/")):
                assert (REPO / source).exists(), f"{name} mounts missing path {source}"
            else:
                assert source in named_volumes, f"{name} uses undeclared volume {source}"
        assert set(svc.get("profiles") or []) <= PROFILES, f"{name}: unknown profile {svc.get('profiles')}"
        assert "healthcheck" in svc or name.endswith("-init"), f"{name} has no health check"
    used = {(v.split(":")[0] if isinstance(v, str) else v.get("source")) for s in services.values() for v in s.get("volumes") or []}
    assert named_volumes <= used, f"declared but unused volumes: {named_volumes - used}"
    for profile in PROFILES:
        assert any(profile in (s.get("profiles") or []) for s in services.values()), f"no service in profile {profile}"


def test_images_are_pinned(services: dict[str, Any]) -> None:
    for name, svc in services.items():
        image = svc.get("image")
        assert image, f"{name} has no image"
        repo_tag = image.split("@", 1)[0]
        tag = repo_tag.rsplit(":", 1)[1] if ":" in repo_tag.rsplit("/", 1)[-1] else ""
        assert tag and tag != "latest", f"{name}: image {image!r} is not pinned"


def test_airflow_image_matches_the_pins() -> None:
    pins = dict(re.findall(r"^([A-Za-z0-9_.\[\]-]+)==(\S+)", (REPO / "requirements.txt").read_text(), re.M))
    airflow = pins["apache-airflow"]
    dockerfile = (REPO / "Dockerfile").read_text()
    assert re.search(rf"^FROM apache/airflow:{re.escape(airflow)}-python3\.11\s*$", dockerfile, re.M), "Dockerfile base = the pin"
    assert f'"apache-airflow=={airflow}"' in dockerfile, "the image's pip install keeps Airflow at the pin"
    assert f"dflash-airflow:{airflow}-" in COMPOSE.read_text()
    for pin in ("apache-airflow-providers-celery", "celery[redis]", "psycopg2-binary", "asyncpg"):
        assert pin in pins, f"requirements.txt pins {pin} (the image installs requirements.txt)"


# -------------------------------------------------------------------- Airflow = what the test proved


def test_airflow_environment_matches_the_celery_test(services: dict[str, Any]) -> None:
    airflow = _airflow_services(services)
    assert len(airflow) >= 6
    proved = CeleryConfig.for_database(PostgresDatabase(admin_url="postgresql://u@h:1/postgres", name="x")).env()
    api = _by_command(services, "api-server")
    api_port = int(str(services[api]["ports"][0]).split(":")[-1])
    shared = None
    for name, svc in airflow.items():
        env = svc["environment"]
        assert env["AIRFLOW__CORE__EXECUTOR"] == proved["AIRFLOW__CORE__EXECUTOR"] == "CeleryExecutor", name
        scheme = proved["AIRFLOW__CELERY__RESULT_BACKEND"].split("://")[0]
        assert env["AIRFLOW__CELERY__RESULT_BACKEND"].startswith(scheme + "://"), f"{name}: result backend must be {scheme}://"
        assert env["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].startswith(proved["AIRFLOW__DATABASE__SQL_ALCHEMY_CONN"].split("://")[0] + "://")
        assert env["AIRFLOW__CELERY__BROKER_URL"].startswith("redis://redis:6379/")
        assert env["AIRFLOW__CORE__EXECUTION_API_SERVER_URL"] == f"http://{api}:{api_port}/execution/", name
        assert len(env["AIRFLOW__API_AUTH__JWT_SECRET"]) >= 64, "64+ byte JWT secret"
        keys = ("AIRFLOW__API_AUTH__JWT_SECRET", "AIRFLOW__CORE__EXECUTION_API_SERVER_URL", "AIRFLOW__CORE__FERNET_KEY",
                "AIRFLOW__DATABASE__SQL_ALCHEMY_CONN", "AIRFLOW__CELERY__BROKER_URL", "AIRFLOW__CELERY__RESULT_BACKEND")
        values = {k: env[k] for k in keys}
        shared = shared or values
        assert values == shared, f"{name} differs from the other components in {set(values.items()) ^ set(shared.items())}"
    db = services["postgres"]["environment"]
    backend = shared["AIRFLOW__CELERY__RESULT_BACKEND"] if shared else ""
    assert f"{db['POSTGRES_USER']}:{db['POSTGRES_PASSWORD']}@postgres:5432/{db['POSTGRES_DB']}" in backend


def test_secrets_come_from_env_example_and_env_is_ignored(raw: dict[str, Any]) -> None:
    used = _variables(COMPOSE.read_text())
    example = _env_example()
    assert used <= set(example), f".env.example lacks {sorted(used - set(example))}"
    assert set(example) <= used, f".env.example has unused {sorted(set(example) - used)}"
    ignored = (REPO / ".gitignore").read_text().split()
    assert ".env" in ignored
    # Every secret-looking setting (and every connection, which carries credentials) is a ${VAR}.
    secretish = re.compile(r"PASSWORD|SECRET|FERNET_KEY|API_KEY|TOKEN|^AIRFLOW_CONN_")
    for name, svc in raw["services"].items():
        for key, value in (svc.get("environment") or {}).items():
            if secretish.search(key) or '"password"' in str(value):
                assert "${" in str(value), f"{name}: {key} is a literal, not from .env"


# ------------------------------------------------------------- commands and ports against the code


def test_sim_command_is_a_valid_simulator_command_and_matches_the_conf(services: dict[str, Any]) -> None:
    from dflash_pipeline.dev.sim.__main__ import build_configs, build_parser

    sim = services["sim"]
    assert sim["entrypoint"] == ["python", "-m", "dflash_pipeline.dev.sim"]
    args = build_parser().parse_args(_argv(sim["command"]))  # exits (SystemExit) on an unknown flag
    configs = build_configs(args)
    assert all(c.host == "0.0.0.0" for c in configs), "listens on the compose network"
    ports = [args.base_port + i for i in range(args.count)]
    assert {int(p) for p in sim["expose"]} == set(ports)
    assert f"localhost:{ports[0]}/health" in " ".join(sim["healthcheck"]["test"])
    conf = _conf("sim")
    assert conf["servers"] == [f"http://sim:{p}" for p in ports], "the conf example uses every simulated server"
    assert {c.served_model_name for c in configs} == {conf["model"]}


def test_sglang_services_one_per_gpu_and_their_connections(services: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    gpus = {n: s for n, s in services.items() if "gpu" in (s.get("profiles") or [])}
    assert len(gpus) >= 2
    devices = []
    for name, svc in gpus.items():
        argv = _argv(svc["entrypoint"]) + _argv(svc["command"])
        assert argv[:3] == ["python3", "-m", "sglang.launch_server"]
        opts = dict(zip(argv[3::2], argv[4::2]))
        assert opts["--reasoning-parser"] == "qwen3"
        assert opts["--port"] == str(SGLANG_PORT) and opts["--host"] == "0.0.0.0"
        assert opts["--served-model-name"] == _conf("gpu")["model"]
        assert opts.get("--api-key"), "the servers require the key the connections send"
        assert f"localhost:{SGLANG_PORT}/health" in " ".join(svc["healthcheck"]["test"])
        assert any(str(v).endswith(":/root/.cache/huggingface") for v in svc["volumes"]), "model cache volume"
        (device,) = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["driver"] == "nvidia" and "gpu" in device["capabilities"] and len(device["device_ids"]) == 1
        devices += device["device_ids"]
    assert len(devices) == len(set(devices)), f"one GPU per server: {devices}"
    # The gpu conf names connections; each resolves (through the code) to one of these services.
    from dflash_pipeline.tasks import resolve_server

    env = services[_by_command(services, "celery worker")]["environment"]
    for key, value in env.items():
        if key.startswith("AIRFLOW_CONN_"):
            monkeypatch.setenv(key, value)
    targets = set()
    for server in _conf("gpu")["servers"]:
        spec = resolve_server(server)
        host_port = spec.base_url.split("://", 1)[1]
        targets.add(host_port)
        assert host_port in {f"{n}:{SGLANG_PORT}" for n in gpus}, f"{server} -> {spec.base_url}"
        assert spec.api_key == _argv(gpus[host_port.split(":")[0]]["command"])[-1]
    assert len(targets) == len(gpus), "the gpu conf example uses every GPU server"


def test_conf_examples_are_valid_conf(compose: dict[str, Any]) -> None:
    from dflash_pipeline.config import RunConfig

    bucket = compose["services"]["minio-init"]["environment"]["DFLASH_BUCKET"]
    for name in CONF_EXAMPLES:
        conf = _conf(name)
        RunConfig.from_params(conf)  # raises on a bad value or an unknown key
        for key in ("prompts_uri", "output_uri"):
            assert conf[key].startswith(f"s3://{bucket}/"), f"{name}: {key} is in the bucket minio-init creates"


def test_s3_connection_points_at_minio(services: dict[str, Any]) -> None:
    minio = services["minio"]
    conn = json.loads(services[_by_command(services, "celery worker")]["environment"]["AIRFLOW_CONN_AWS_DEFAULT"])
    assert conn["conn_type"] == "aws"
    assert conn["extra"]["endpoint_url"] == "http://minio:9000" and "9000:9000" in minio["ports"]
    assert (conn["login"], conn["password"]) == (minio["environment"]["MINIO_ROOT_USER"], minio["environment"]["MINIO_ROOT_PASSWORD"])


def sglang_abilities(tag: str) -> dict[str, Any]:
    """What an SGLang release gives this pipeline, by the code's own tables: token ids
    (serving/abilities.py), per-request speculative statistics (serving/specwire.py)."""
    from dflash_pipeline.serving.abilities import IDS_BOTH, token_ids_expected
    from dflash_pipeline.serving.specwire import parse_version, sglang_spec_config

    version = tag.split("-", 1)[0]  # v0.5.19-cu129 -> v0.5.19
    assert parse_version(version) is not None, f"unreadable SGLang tag {tag!r}"
    spec = sglang_spec_config({"speculative_algorithm": "EAGLE3", "speculative_num_draft_tokens": 4, "version": version})
    return {"token_ids": token_ids_expected("sglang", version) == IDS_BOTH,
            "spec_stats": spec is not None and spec.stats_source is not None}


@pytest.mark.parametrize(("tag", "ok"), [("v0.5.14", False), ("v0.5.16", False), ("v0.5.17", True),
                                         ("v0.5.19-cu129", True), ("v0.5.23", True)])
def test_sglang_ability_check_tells_releases_apart(tag: str, ok: bool) -> None:
    assert all(sglang_abilities(tag).values()) is ok


def test_sglang_pin_has_every_ability_we_use(services: dict[str, Any]) -> None:
    """The gpu profile's SGLang release returns token ids and per-request speculative statistics,
    and runs the reasoning parser (an older pin makes rows fall back to re-encoding silently)."""
    for name, svc in services.items():
        repo, _, tag = svc["image"].partition(":")
        if repo != "lmsysorg/sglang":
            continue
        missing = [k for k, ok in sglang_abilities(tag).items() if not ok]
        assert not missing, f"{name}: {svc['image']} lacks {missing} (docs/engines.md)"
        assert "--reasoning-parser" in _argv(svc["command"]), name
