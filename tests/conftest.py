"""Shared fixtures: real processes on loopback (moto S3, simulated SGLang servers, Airflow).

Fixtures (see each docstring):

* ``moto_server`` (session): a ``moto_server`` subprocess, a :class:`MotoServer`.
* ``s3_client`` (session): boto3 S3 client for it.
* ``bucket`` (function): a fresh, empty bucket name, emptied and deleted afterwards.
* ``aws_conn_env`` (function): env so ``S3Hook(aws_conn_id="aws_default")`` and boto3 talk to moto.
* ``sim_fleet`` (function): factory ``sim_fleet(count=1, **SimConfig fields) -> SimFleet`` (in-process).
* ``qwen_tokenizer`` (session): directory of Qwen's real BPE (tokenizer.json + tokenizer_config.json),
  built from the dashscope wheel on first use; skips when the wheel cannot be fetched (fails in CI).
* ``trainers_python`` (session) / ``run_loaders``: the trainers' own loaders (SpecForge, speculators,
  datasets) in .venv-trainers, run as a subprocess (tests/trainers/loaders.py).
* ``airflow_dags_dir`` (session): a temporary folder parsed by ``airflow_stack`` as the extra DAG
  bundle ``test-dags``; drop throw-away DAG files in it, then ``airflow_stack.trigger(...)``.
* ``airflow_stack`` (slow tests only; one stack per session): a running :class:`AirflowStack` with the
  repo's ``dags/`` and ``plugins/``, the ``test-dags`` bundle, and ``aws_default`` pointing at moto.

Importing Airflow in the test process would write ``~/airflow``: unless ``AIRFLOW_HOME`` is set,
it is pointed at a temporary folder for the session.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

if "AIRFLOW_HOME" not in os.environ:  # before anything imports airflow
    os.environ["AIRFLOW_HOME"] = tempfile.mkdtemp(prefix="dflash-test-airflow-home-")
    os.environ.setdefault("AIRFLOW__CORE__LOAD_EXAMPLES", "False")

from dflash_pipeline.dev.stack import AirflowStack, MotoServer  # noqa: E402

if TYPE_CHECKING:
    from dflash_pipeline.dev.sim import SimFleet

REPO = Path(__file__).resolve().parents[1]
TEST_DAGS_BUNDLE = "test-dags"


# ---------------------------------------------------------------------------------------- S3


@pytest.fixture(scope="session")
def moto_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoServer]:
    """A real ``moto_server`` subprocess on 127.0.0.1 (S3 over HTTP), shared by the session.

    Use ``.endpoint_url``, ``.client()``, ``.create_bucket(name)``, ``.env()`` (AWS + Airflow
    connection environment). Prefer the ``bucket`` fixture to get an isolated bucket per test.
    """
    server = MotoServer(log_path=tmp_path_factory.mktemp("moto") / "moto.log").start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def s3_client(moto_server: MotoServer) -> Any:
    """A boto3 S3 client for ``moto_server``."""
    return moto_server.client()


@pytest.fixture
def bucket(moto_server: MotoServer, s3_client: Any) -> Iterator[str]:
    """Name of a new empty bucket on ``moto_server``; its objects and itself are deleted afterwards."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    moto_server.create_bucket(name)
    yield name
    paginator = s3_client.get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=name):
        keys = [{"Key": obj["Key"]} for obj in page.get("Contents", [])]
        if keys:
            s3_client.delete_objects(Bucket=name, Delete={"Objects": keys})
    s3_client.delete_bucket(Bucket=name)


@pytest.fixture
def aws_conn_env(moto_server: MotoServer, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """Point ``aws_default`` and boto3 at ``moto_server`` for this test (monkeypatched env).

    Sets ``AIRFLOW_CONN_AWS_DEFAULT`` (conn JSON with the moto ``endpoint_url``), fake
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``, ``AWS_DEFAULT_REGION`` and
    ``AWS_ENDPOINT_URL_S3``; removes ``AWS_PROFILE``/``AWS_SESSION_TOKEN``. Returns what it set.
    """
    env = moto_server.env()
    for name in ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return env


# ------------------------------------------------------------------------------ simulated fleet


@pytest.fixture
def sim_fleet() -> Iterator[Callable[..., SimFleet]]:
    """Factory for in-process simulated SGLang fleets, stopped after the test.

    ``sim_fleet(count=1, engines=None, **overrides)`` starts ``SimFleet.uniform(count, **overrides)`` (the
    overrides are ``SimConfig`` fields, e.g. ``token_time_s=0.001, length_scale=0.05``) and returns
    it started: ``.urls`` (base URLs), ``.servers`` (``SimServer`` objects: ``.url``, ``.stats()``...).
    ``engines=["vllm", "sglang"]`` starts one server per entry with that wire flavour instead.
    """
    from dflash_pipeline.dev.sim import SimFleet  # lazy: the simulator is optional for most tests

    fleets: list[SimFleet] = []

    def start(count: int = 1, engines: list[str] | None = None, **overrides: Any) -> SimFleet:
        from dflash_pipeline.dev.sim import SimConfig

        if engines is None:
            fleet = SimFleet.uniform(count, **overrides).start()
        else:  # server i speaks engines[i]'s wire
            fleet = SimFleet(SimConfig(**{**overrides, "engine": e}) for e in engines).start()
        fleets.append(fleet)
        return fleet

    yield start
    for fleet in reversed(fleets):
        fleet.stop()


# ------------------------------------------------------------------------------ Qwen tokenizer


@pytest.fixture(scope="session")
def qwen_tokenizer() -> Path:
    """Directory with Qwen's byte-level BPE (151,643 ranks + Qwen3 special tokens) and a Qwen3-style
    chat template (``make qwen-tokenizer``; cached in ~/.cache/dflash-pipeline/qwen-bpe).

    Skips with the reason when the dashscope wheel cannot be fetched from PyPI, unless
    ``DFLASH_REQUIRE_QWEN_BPE=1`` (set by .ci/run), where it fails."""
    from dflash_pipeline.dev.qwen_tokenizer import QwenTokenizerUnavailable, ensure_qwen_tokenizer

    try:
        return ensure_qwen_tokenizer()
    except QwenTokenizerUnavailable as exc:
        if os.environ.get("DFLASH_REQUIRE_QWEN_BPE") == "1":
            pytest.fail(f"Qwen BPE tokenizer required but unavailable: {exc}")
        pytest.skip(f"Qwen BPE tokenizer unavailable (the dashscope wheel could not be fetched): {exc}")


# ---------------------------------------------------------------------------------- trainers

TRAINER_LOADERS = Path(__file__).parent / "trainers" / "loaders.py"


@pytest.fixture(scope="session")
def trainers_python() -> Path:
    python = REPO / ".venv-trainers" / "bin" / "python"
    if not (python.is_file() and (REPO / ".venv-trainers" / ".installed").is_file()):
        message = "no .venv-trainers: run `make trainers-venv` (SpecForge, speculators, datasets)"
        if os.environ.get("DFLASH_REQUIRE_TRAINERS_VENV") == "1":
            pytest.fail(message)
        pytest.skip(message)
    return python


@pytest.fixture
def run_loaders(trainers_python: Path, tmp_path: Path) -> Callable[..., list[tuple[dict[str, Any], list[dict[str, Any]]]]]:
    """run_loaders([(command, [args...]), ...]): tests/trainers/loaders.py's commands in one .venv-trainers
    process (one import of torch and the trainers); per command, its summary and the rows it dumped."""

    def run(jobs: list[tuple[str, list[str]]]) -> list[tuple[dict[str, Any], list[dict[str, Any]]]]:
        outs = [tmp_path / f"{i}-{command}.dump.jsonl" for i, (command, _) in enumerate(jobs)]
        spec = tmp_path / "jobs.json"
        spec.write_text(json.dumps([[command, *args, "--out", str(out)] for (command, args), out in zip(jobs, outs)]))
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
               "HF_HOME": str(tmp_path / "hf-home"), "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"}
        proc = subprocess.run([str(trainers_python), str(TRAINER_LOADERS), "batch", "--jobs", str(spec)],
                              capture_output=True, text=True, env=env, timeout=900, check=False)
        assert proc.returncode == 0, f"loaders failed ({proc.returncode}):\n{proc.stderr[-6000:]}"
        summaries = json.loads(proc.stdout.strip().splitlines()[-1])
        return [(summary, [json.loads(line) for line in out.read_text().splitlines()])
                for summary, out in zip(summaries, outs)]

    return run


# ---------------------------------------------------------------------------------- Airflow


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that used ``airflow_stack`` gets the components' log tails in its report."""
    outcome = yield
    report = outcome.get_result()
    stack = getattr(item, "funcargs", {}).get("airflow_stack")
    if report.when == "call" and report.failed and isinstance(stack, AirflowStack):
        for log_file in sorted(stack.logs_dir.glob("*.log")):
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-60:])
            report.sections.append((f"airflow {log_file.stem} (last 60 lines)", tail))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """`make test` runs two pytest-xdist workers with `--dist loadfile`; this scheduler hands out whole
    test files (a module-scoped run is made once, in one worker) except that the real-engine tier is
    one unit (its vLLM servers are session fixtures: each started once, in one worker, not twice).
    Why not `--dist loadgroup` with marks: xdist 3.8.0 names the group by setting `item._nodeid`,
    which pytest 9.2 no longer reads, so every marked test went to any worker."""
    if config.getvalue("dist") not in ("loadfile", "loadscope"):
        return None
    from xdist.scheduler import LoadScopeScheduling

    class FilesAndEngineTier(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "tests/engine/" if path.startswith("tests/engine/") else path

    return FilesAndEngineTier(config, log)


@pytest.fixture(scope="session")
def airflow_dags_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A temporary folder parsed by ``airflow_stack`` as DAG bundle ``test-dags``.

    Write a DAG file into it, then call ``airflow_stack.trigger(dag_id, ...)``: it waits until the
    DAG is parsed (new files are seen within ~5 s). Use unique DAG ids: the folder is per session.
    """
    return tmp_path_factory.mktemp("test-dags")


@pytest.fixture(scope="session")
def hf_hub_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An empty Hugging Face hub cache (HF_HUB_CACHE) the session's Airflow stack reads, offline
    (HF_HUB_OFFLINE=1): fill it (the layout huggingface_hub writes) to pass a Hugging Face id as `tokenizer`."""
    return tmp_path_factory.mktemp("hf-hub")


@pytest.fixture(scope="session")
def _airflow_stack_session(
    tmp_path_factory: pytest.TempPathFactory, moto_server: MotoServer, airflow_dags_dir: Path, hf_hub_cache: Path
) -> Iterator[AirflowStack]:
    plugins = REPO / "plugins"
    stack = AirflowStack(
        tmp_path_factory.mktemp("airflow-stack"),
        REPO / "dags",
        plugins if plugins.is_dir() else None,
        {**moto_server.env(), "HF_HUB_CACHE": str(hf_hub_cache), "HF_HUB_OFFLINE": "1"},
        extra_dag_folders={TEST_DAGS_BUNDLE: airflow_dags_dir},
        wait_for_dags=(),  # trigger() waits for its own DAG; a broken dags/ file fails only its tests
    )
    stack.start()
    yield stack
    stack.stop()


@pytest.fixture
def airflow_stack(request: pytest.FixtureRequest) -> AirflowStack:
    """The session's running Airflow (LocalExecutor, SQLite), for tests marked ``slow`` only.

    Started on first use (~11 s) and stopped at the end of the session. API:
    ``trigger(dag_id, conf, run_id=None) -> run_id`` (the ``airflow dags trigger`` CLI; waits for
    the DAG to be parsed first), ``wait_run(dag_id, run_id, timeout_s) -> "success" | "failed"``,
    ``task_instances(dag_id, run_id) -> list[TaskInstanceInfo]`` (task_id, map_index, state,
    try_number, hostname, raw), ``rest(method, path, json=None, params=None) -> requests.Response``
    (bearer token handled), ``cli(*args) -> CompletedProcess``, ``url``, ``ui_run_url(...)``,
    ``logs_dir``. Tasks see ``aws_default`` -> ``moto_server``. The stack is shared by the session:
    use your own bucket (``bucket`` fixture) or prefix. A failing test's report shows the log tails.
    """
    if request.node.get_closest_marker("slow") is None:
        pytest.fail("the airflow_stack fixture is for tests marked @pytest.mark.slow")
    stack: AirflowStack = request.getfixturevalue("_airflow_stack_session")
    return stack
