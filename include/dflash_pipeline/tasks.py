"""The bodies of the DAG's tasks: Airflow in, plain library calls, Airflow exceptions out.

This is the only module that knows about Airflow (hooks, connections, exception types), and it
imports Airflow inside the functions so that importing it at DAG-parse time costs nothing.
Errors a retry cannot fix become `AirflowFailException` (no retries burnt); transient ones are
re-raised as they are, so Airflow retries the task.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

from dflash_pipeline.config import ConfigError, RunConfig
from dflash_pipeline.dataset.layout import DatasetLayout, UriError

if TYPE_CHECKING:  # the DAG files import this module at parse time: no HTTP client then
    from dflash_pipeline.serving.sglang import ServerSpec

logger = logging.getLogger(__name__)

T = TypeVar("T")


@contextmanager
def _fail_fast() -> Iterator[None]:
    """Turn what a retry cannot fix into AirflowFailException with the original message."""
    from airflow.sdk.exceptions import AirflowFailException

    from dflash_pipeline.dataset.store import StoreConfigError
    from dflash_pipeline.steps.generate import ServerConfigError
    from dflash_pipeline.steps.plan import PlanError
    from dflash_pipeline.steps.tokenize import TokenizeFailed
    from dflash_pipeline.steps.validate import ValidationFailed
    from dflash_pipeline.steps.validate.partwatch import RunStoppedEarly

    try:
        yield
    except (ConfigError, PlanError, ServerConfigError, StoreConfigError, ValidationFailed, UriError,
            TokenizeFailed, RunStoppedEarly) as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc


def params_from(schemas: dict[str, dict[str, Any]], essentials: tuple[str, ...] = ()) -> dict[str, Any]:
    """A DAG's `Param`s from the package's JSON schemas (one source for the UI form, the CLI and
    the tests); a schema without a default is a required param. With `essentials`, laid out for the
    trigger form by `config.form_layout`: those first and open, every other param under "Advanced: ..."."""
    from airflow.sdk import Param

    from dflash_pipeline.config.run import form_layout

    if essentials:
        schemas = form_layout(schemas, essentials)
    return {name: Param(schema["default"], **{k: v for k, v in schema.items() if k != "default"})
            if "default" in schema else Param(**schema)
            for name, schema in schemas.items()}


def completions_asset() -> Any:
    """The hand-off Asset (steps.handoff names it; the Asset object is Airflow's, so it is built here)."""
    from airflow.sdk import Asset

    from dflash_pipeline.steps.handoff import ASSET_NAME, ASSET_URI

    return Asset(name=ASSET_NAME, uri=ASSET_URI, group="dflash")


def tokenized_asset() -> Any:
    """dflash_tokenize's outlet Asset (named in steps.handoff)."""
    from airflow.sdk import Asset

    from dflash_pipeline.steps.handoff import TOKENIZED_ASSET_NAME, TOKENIZED_ASSET_URI

    return Asset(name=TOKENIZED_ASSET_NAME, uri=TOKENIZED_ASSET_URI, group="dflash")


def s3_client(aws_conn_id: str) -> Any:
    """A boto3 S3 client from the Airflow AWS connection (credentials never pass through us), with
    bounded timeouts and retries (`store.CLIENT_CONFIG`) unless the connection's extra sets its own."""
    from airflow.providers.amazon.aws.hooks.s3 import S3Hook
    from botocore.config import Config

    from dflash_pipeline.dataset.store import CLIENT_CONFIG

    hook = S3Hook(aws_conn_id=aws_conn_id)
    config = Config(**CLIENT_CONFIG).merge(hook.config)
    return hook.get_client_type(region_name=hook.region_name, config=config)


def on_task_failure(context: Any) -> None:
    """The DAGs' `on_failure_callback`: the try's reason for the run's page (`_record_failure`)."""
    _record_failure(context, "failed")


def on_task_retry(context: Any) -> None:
    """The DAGs' `on_retry_callback`: the try's reason for the run's page (`_record_failure`)."""
    _record_failure(context, "up_for_retry")


def _record_failure(context: Any, state: str) -> None:
    """The try's reason under the run's dataset root, for the run's page (monitor/failures.py). Best effort;
    a run without an output_uri records nothing."""
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.monitor.failures import failure_doc, record_failure

    try:
        params = context.get("params") or {}
        output_uri = params.get("output_uri")
        if not output_uri:
            return
        ti = context["ti"]
        exc = context.get("exception")
        if exc is not None and exc.__cause__ is not None and type(exc).__name__ == "AirflowFailException":
            exc = exc.__cause__  # the message _fail_fast wrapped, under its own class
        layout = DatasetLayout.from_uri(str(output_uri))
        store = Store(s3_client(str(params.get("aws_conn_id") or "aws_default")), layout.bucket)
        doc = failure_doc(ti.task_id, int(ti.map_index if ti.map_index is not None else -1), int(ti.try_number),
                          state, exc)
        record_failure(store, layout, context["run_id"], doc)
    except Exception as exc:  # noqa: BLE001 - a callback must never hide the task's own failure
        logger.warning("could not record the task's failure: %r", exc)


def resolve_server(name: str) -> ServerSpec:
    """A base URL as given, or an Airflow connection: host (with or without scheme), port, password = API key."""
    from dflash_pipeline.serving.sglang import ServerSpec

    if name.startswith(("http://", "https://")):
        return ServerSpec(name=name, base_url=name.rstrip("/"))
    from airflow.sdk import BaseHook

    try:
        conn = BaseHook.get_connection(name)
    except Exception as exc:  # noqa: BLE001 - AirflowNotFoundException and friends
        raise ConfigError(f"server {name!r} is neither an http(s) URL nor a usable Airflow connection: {exc}") from exc
    host = (conn.host or "").rstrip("/")
    if not host:
        raise ConfigError(f"connection {name!r} has no host")
    if "://" not in host:
        scheme = conn.schema if conn.schema in ("http", "https") else "http"
        host = f"{scheme}://{host}"
    base = f"{host}:{conn.port}" if conn.port else host
    return ServerSpec(name=name, base_url=base, api_key=conn.password or None)


def config_from_params(params: dict[str, Any]) -> RunConfig:
    with _fail_fast():
        return RunConfig.from_params(dict(params))


def plan(params: dict[str, Any], run_id: str) -> dict[str, Any]:
    from dflash_pipeline.steps.plan import run_plan

    cfg = config_from_params(params)
    with _fail_fast():
        return run_plan(s3_client(cfg.aws_conn_id), cfg, run_id)


def preflight(params: dict[str, Any], run_id: str) -> list[dict[str, Any]]:
    from dflash_pipeline.steps.preflight import run_preflight

    cfg = config_from_params(params)
    with _fail_fast():
        specs = [resolve_server(s) for s in cfg.servers]
        return run_preflight(s3_client(cfg.aws_conn_id), cfg, specs, run_id)


def _wait_for_server(spec: ServerSpec, deadline_s: float, check: Callable[[], bool]) -> None:
    from dflash_pipeline.steps.generate import ServerLost

    start = time.monotonic()
    while not check():
        waited = time.monotonic() - start
        if waited >= deadline_s:
            raise ServerLost(f"server {spec.name} did not answer /health for {waited:.0f}s")
        logger.warning("server %s not healthy yet; waiting (%.0fs so far)", spec.name, waited)
        time.sleep(min(5.0, max(0.5, deadline_s / 10)))


def generate(
    params: dict[str, Any],
    run_id: str,
    server: dict[str, Any],
    map_index: int,
    try_number: int,
    on_progress: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Drive one server until the dataset is complete; return a small summary for XCom."""
    import json

    from dflash_pipeline.dataset.store import Store, with_retries
    from dflash_pipeline.serving.sglang import check_health, new_session
    from dflash_pipeline.steps.generate import Worker, WorkerSettings, settings_for

    cfg = config_from_params(params)
    with _fail_fast():
        spec = resolve_server(server["server"])
        layout = DatasetLayout.from_uri(cfg.output_uri)
        store = Store(s3_client(cfg.aws_conn_id), layout.bucket)
        # Retried: a task (re)started during an S3 outage waits for it like the worker does.
        got = with_retries(lambda: store.get(layout.manifest_key), what="manifest", deadline_s=WorkerSettings.store_deadline_s)
        if got is None:
            raise ConfigError(f"{layout.uri}/manifest.json is missing; plan did not run")
        manifest = json.loads(got[0])
        settings = settings_for(
            cfg, run_id=run_id, map_index=map_index, server=spec, server_info=server, try_number=try_number
        )
        if on_progress is None:
            from dflash_pipeline.monitor.progress import ProgressWriter

            on_progress = ProgressWriter(
                store, layout.progress_key(run_id, settings.worker), run_id=run_id, try_number=try_number,
                every_s=settings.progress_every_s, n_servers=len(cfg.servers),
            )
        watcher = part_watcher(cfg, params, store, layout, manifest, run_id, settings.worker, server=spec.name,
                               try_number=try_number)
        worker = Worker(store, layout, manifest, settings, on_progress=on_progress,
                        on_part_committed=watcher.committed)
        watcher.on_stop = lambda message: worker.request_stop()
        if worker.all_done():
            watcher.close(0)
            logger.info("every chunk of %s is already committed; nothing to do for %s", layout.uri, spec.name)
            return {"worker": settings.worker, "server": spec.name, "nothing_to_do": True, "completions": 0}
        session = new_session()
        _wait_for_server(spec, cfg.server_lost_after_s, lambda: check_health(session, spec))
        return _run_watched(worker, watcher)


def part_watcher(cfg: RunConfig, params: dict[str, Any], store: Any, layout: DatasetLayout, manifest: dict[str, Any],
                 run_id: str, worker: str, server: str | None = None, try_number: int = 1) -> Any:
    """The generate task's on-part-committed hook: digests, live quality, fail fast (steps/validate/partwatch.py)."""
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.steps.quality.live import limits_from
    from dflash_pipeline.steps.validate.partwatch import PartWatcher
    from dflash_pipeline.steps.validate.run import digest_context, load_recounter_for

    quality = QualitySettings.from_params(params)
    thinking = bool(manifest["pinned"]["sampling"]["enable_thinking"])
    recounter = load_recounter_for(store.client, cfg.tokenizer, thinking)
    return PartWatcher(store, layout, digest_context(manifest, quality, recounter, cfg.tokenizer), run_id=run_id,
                       worker=worker, fail_fast=cfg.fail_fast, server=server, try_number=try_number,
                       limits=limits_from(cfg.max_truncation_rate, cfg.max_missing_reasoning_rate, cfg.max_loop_rate))


def _run_watched(worker: Any, watcher: Any) -> dict[str, Any]:
    """Run the worker; a live figure surely above its limit stops it and fails the task with the figure."""
    from dflash_pipeline.steps.generate import TaskStopped
    from dflash_pipeline.steps.validate.partwatch import RunStoppedEarly

    try:
        with _stop_on_sigterm(worker.request_stop):
            result = worker.run()
    except TaskStopped as exc:
        watcher.close(5.0)
        if watcher.verdict:
            raise RunStoppedEarly(watcher.verdict) from exc
        raise
    except BaseException:
        watcher.close(5.0)
        raise
    watcher.close(120.0)
    if watcher.verdict:  # the figure came with the last parts: the run is complete, validation judges it
        logger.warning("%s", watcher.verdict)
    result["digests_written"] = watcher.digests_written
    return result


def _stop_on_sigterm(request_stop: Callable[[], None]) -> Any:
    """SIGTERM (a task cleared or marked failed in the UI or over REST, a pod eviction, a Celery warm
    shutdown) asks the worker to stop: it commits what is complete, saves finished rows and releases
    its claims within its stop grace (3 s), before the supervisor's SIGKILL 5 s later. The request is
    made from a thread of its own, never inside the signal handler (stopsignal.py: a handler that sets
    an Event can deadlock the main thread). The task runner's own handler (it calls `on_kill`) still
    runs."""
    from dflash_pipeline.steps.generate.stopsignal import SignalStop

    return SignalStop(request_stop)


def validate(params: dict[str, Any], outlet_events: Any = None, run_id: str | None = None) -> dict[str, Any]:
    """Validate and count; on success, annotate the hand-off asset's event (`outlet_events`).
    With `run_id`, first copy each server's in-flight limit over the run into the manifest."""
    from dflash_pipeline.steps.handoff import event_extra
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.steps.validate import Thresholds, run_validation

    cfg = config_from_params(params)
    if run_id is not None:
        _record_concurrency(cfg, run_id)
    thresholds = Thresholds(
        max_error_rate=cfg.max_error_rate, max_truncation_rate=cfg.max_truncation_rate, min_coverage=cfg.min_coverage,
        max_missing_reasoning_rate=cfg.max_missing_reasoning_rate, max_loop_rate=cfg.max_loop_rate,
    )
    with _fail_fast():
        report = run_validation(s3_client(cfg.aws_conn_id), cfg.output_uri, thresholds=thresholds, tokenizer=cfg.tokenizer,
                                quality=QualitySettings.from_params(params), target_mix=cfg.target_mix)
    keys = (
        "prompts", "completions", "errors", "missing", "duplicates", "truncated", "empty_content",
        "prompt_tokens", "output_tokens", "reasoning_tokens", "training_tokens",
    )
    summary = {k: report[k] for k in keys}
    summary["report_key"] = report["report_key"]
    if outlet_events is not None:
        extra = event_extra(report)
        outlet_events[completions_asset()].extra = extra
        logger.info("asset event %s: %s", completions_asset().uri, extra)
    return summary


def near_duplicates(params: dict[str, Any]) -> dict[str, Any]:
    """The plan's near-duplicate prompts, found beside generation (validation reuses them)."""
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.steps.validate.run import near_duplicates as find, read_manifest

    cfg = config_from_params(params)
    quality = QualitySettings.from_params(params)
    if not quality.enabled:
        return {"skipped": "quality_signals is false"}
    with _fail_fast():
        layout = DatasetLayout.from_uri(cfg.output_uri)
        store = Store(s3_client(cfg.aws_conn_id), layout.bucket)
        rows, summary, key = find(store, layout, read_manifest(store, layout), quality)
    return {"key": key, "duplicates": len(rows), **{k: v for k, v in summary.items() if k != "computed"}}


def digest_shards(params: dict[str, Any]) -> list[int]:
    """The shards of the remaining digest work: one mapped task each (validation_workers)."""
    return list(range(config_from_params(params).validation_workers))


def digest_parts(params: dict[str, Any], shard: int) -> dict[str, Any]:
    """Compute the digests validation still lacks for one shard of the chunks."""
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.steps.validate.run import compute_digests

    cfg = config_from_params(params)
    with _fail_fast():
        return compute_digests(s3_client(cfg.aws_conn_id), cfg.output_uri, shard, cfg.validation_workers,
                               tokenizer=cfg.tokenizer, quality=QualitySettings.from_params(params))


def _record_concurrency(cfg: Any, run_id: str) -> None:
    """Best effort: the manifest's record of each server's discovered concurrency (a failure here
    never fails validation; the progress objects keep the same figures)."""
    from dflash_pipeline.dataset.store import Store
    from dflash_pipeline.steps.preflight import record_concurrency

    layout = DatasetLayout.from_uri(cfg.output_uri)
    try:
        found = record_concurrency(Store(s3_client(cfg.aws_conn_id), layout.bucket), layout, run_id)
        logger.info("in-flight limits recorded in the manifest: %s",
                    {k: (v.get("mode"), v.get("final_limit")) for k, v in found.items()})
    except Exception as exc:  # noqa: BLE001 - a record, not a check
        logger.warning("could not record the servers' in-flight limits in the manifest: %s", exc)


# ------------------------------------------------------------------------------ dflash_tokenize


def tokenize_config(params: dict[str, Any]) -> Any:
    from dflash_pipeline.config import TokenizeConfig

    with _fail_fast():
        return TokenizeConfig.from_params(dict(params))


def tokenize_prepare(params: dict[str, Any], triggering_asset_events: Any) -> list[dict[str, Any]]:
    """Which datasets (the completions asset's events, else the output_uri param), checked and split
    among the workers: one assignment per worker (each also lists the datasets, for the report)."""
    from airflow.sdk.exceptions import AirflowFailException

    from dflash_pipeline.steps import handoff
    from dflash_pipeline.steps.tokenize import plan

    cfg = tokenize_config(params)
    events = triggering_asset_events.get(completions_asset(), []) if triggering_asset_events else []
    extras = handoff.extras_from_events(events)
    from_events = bool(extras)
    if not extras and cfg.output_uri:
        extras = [{"output_uri": cfg.output_uri}]
    if not extras:
        raise AirflowFailException("no dflash_completions asset event and no output_uri param: nothing to tokenize")
    client = s3_client(cfg.aws_conn_id)
    with _fail_fast():
        # Events may name datasets deleted since (skipped, with a warning); an output_uri asked for by
        # hand must exist.
        checked = (handoff.check_events(client, extras) if from_events
                   else [handoff.check_handoff(client, extra) for extra in extras])
        planned = plan(client, [c["output_uri"] for c in checked], cfg)
    return [dict(a, datasets=planned["datasets"]) for a in planned["assignments"]]


def tokenize_worker(params: dict[str, Any], assignment: dict[str, Any]) -> dict[str, Any]:
    from dflash_pipeline.steps.tokenize import run_assignment

    cfg = tokenize_config(params)
    with _fail_fast():
        return run_assignment(s3_client(cfg.aws_conn_id), assignment)


def tokenize_report(params: dict[str, Any], datasets: list[dict[str, Any]], outlet_events: Any = None) -> list[dict[str, Any]]:
    """Write each dataset's tokenized report; on success the dflash_tokenized event names them."""
    from dflash_pipeline.steps.handoff import TOKENIZED_FORMAT
    from dflash_pipeline.steps.tokenize import write_report

    cfg = tokenize_config(params)
    client = s3_client(cfg.aws_conn_id)
    keys = ("output_uri", "tokenization", "answers", "report_key", "card_key", "tokenized_prefix", "files", "rows_in", "rows_out", "rows_dropped",
            "dropped_by_reason", "ids_source", "unverified", "tokens", "loss_tokens", "truncated_to_max_length",
            "gate", "dropped_by_thinking")
    with _fail_fast():
        summaries = [{k: r[k] for k in keys}
                     for r in (write_report(client, d, cfg.min_kept_share, target_mix=cfg.target_mix) for d in datasets)]
    if outlet_events is not None:
        outlet_events[tokenized_asset()].extra = {"format": TOKENIZED_FORMAT, "datasets": summaries}
    return summaries


# ------------------------------------------------------------------------------ dflash_eval


def eval_asset() -> Any:
    """dflash_eval's outlet Asset (named in steps.handoff)."""
    from airflow.sdk import Asset

    from dflash_pipeline.steps.handoff import EVAL_ASSET_NAME, EVAL_ASSET_URI

    return Asset(name=EVAL_ASSET_NAME, uri=EVAL_ASSET_URI, group="dflash")


def eval_config(params: dict[str, Any]) -> Any:
    from dflash_pipeline.config import EvalConfig

    with _fail_fast():
        return EvalConfig.from_params(dict(params))


def eval_prepare(params: dict[str, Any], run_id: str) -> list[dict[str, Any]]:
    """Plan and preflight every (group, condition) dataset; one assignment per server (XCom: small)."""
    from dflash_pipeline.steps.evaluate import prepare

    cfg = eval_config(params)
    with _fail_fast():
        return prepare(s3_client(cfg.aws_conn_id), cfg, run_id, resolve_server)


def eval_server(params: dict[str, Any], run_id: str, assignment: dict[str, Any], try_number: int) -> dict[str, Any]:
    """One server through its group's conditions (the generate Worker each), /metrics scraped around each."""
    from dflash_pipeline.steps.evaluate import run_server

    cfg = eval_config(params)

    def progress(store: Any, key: str, settings: Any, n_servers: int) -> Any:
        from dflash_pipeline.monitor.progress import ProgressWriter

        return ProgressWriter(store, key, run_id=run_id, try_number=try_number, every_s=settings.progress_every_s,
                              n_servers=n_servers)

    with _fail_fast():
        spec = resolve_server(assignment["server"])
        return run_server(s3_client(cfg.aws_conn_id), cfg, assignment, run_id, spec, try_number=try_number,
                          progress_factory=progress)


def eval_report(params: dict[str, Any], run_id: str, assignments: list[dict[str, Any]] | None,
                outlet_events: Any = None) -> dict[str, Any]:
    """Write the eval report (also after a failed prepare: `assignments` is then empty); fail the task
    when a condition measured nothing, nothing was planned, or planned rows are missing; otherwise the
    dflash_eval event carries the report's status and per drafter and condition what was measured."""
    from airflow.sdk.exceptions import AirflowFailException

    from dflash_pipeline.steps.evaluate import EvalFailed, EvalIncomplete, run_report
    from dflash_pipeline.steps.handoff import eval_event_extra

    cfg = eval_config(params)
    try:
        with _fail_fast():
            report = run_report(s3_client(cfg.aws_conn_id), cfg, list(assignments or []), run_id)
    except (EvalFailed, EvalIncomplete) as exc:
        raise AirflowFailException(f"{type(exc).__name__}: {exc}") from exc
    extra = eval_event_extra(report)
    if outlet_events is not None:
        outlet_events[eval_asset()].extra = extra
        logger.info("asset event %s: %s", eval_asset().uri, extra)
    return extra


# ------------------------------------------------------------------------------ dflash_train


def drafter_asset() -> Any:
    """dflash_train's outlet Asset (named in steps.handoff): one event per run, naming each drafter's card."""
    from airflow.sdk import Asset

    from dflash_pipeline.steps.handoff import DRAFTER_ASSET_NAME, DRAFTER_ASSET_URI

    return Asset(name=DRAFTER_ASSET_NAME, uri=DRAFTER_ASSET_URI, group="dflash")


def train_config(params: dict[str, Any]) -> Any:
    from dflash_pipeline.config import TrainConfig

    with _fail_fast():
        return TrainConfig.from_params(dict(params))


def train_check(params: dict[str, Any], triggering_asset_events: Any) -> dict[str, list[dict[str, Any]]]:
    """Every check before any work (steps/train/checks.py; the pod spec too on kubernetes): the jobs by backend.

    {"local": [job...], "kubernetes": [job...], "pods": [KubernetesPodOperator kwargs...], "done": [job...]}:
    a job whose card exists with the same settings is 'done' (nothing to train; its card is re-announced)."""
    from dflash_pipeline.steps.handoff import tokenized_datasets
    from dflash_pipeline.steps.train.checks import check_train, claim_job, jobs_for
    from dflash_pipeline.steps.train.kubernetes import pod_kwargs

    cfg = train_config(params)
    events = triggering_asset_events.get(tokenized_asset(), []) if triggering_asset_events else []
    datasets = tokenized_datasets(events)
    out: dict[str, list[dict[str, Any]]] = {"local": [], "kubernetes": [], "pods": [], "done": []}
    client = s3_client(cfg.aws_conn_id)
    with _fail_fast():  # TrainRefused is a ConfigError: the task fails at once, no retry
        pairs = jobs_for(cfg, datasets)
        jobs = [check_train(client, cfg, uri, tokenization, several=len(pairs) > 1) for uri, tokenization in pairs]
        pods = {j["name"]: pod_kwargs(j, cfg) for j in jobs} if cfg.backend == "kubernetes" else {}
        for job in (claim_job(client, j) for j in jobs):  # every check passed: now the names are claimed
            logger.info("drafter %s (%s): %s on %s tokenization %r", job["name"], job["prefix"], job["status"],
                        job["dataset"]["uri"], job["tokenization"]["name"])
            if job["status"] == "done":
                out["done"].append(job)
            elif cfg.backend == "kubernetes":
                out["kubernetes"].append(job)
                out["pods"].append(pods[job["name"]])
            else:
                out["local"].append(job)
    return out


def train_local(params: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """Run the trainer in the trainers' venv on this worker; upload the drafter (not the card)."""
    from dflash_pipeline.steps.train.local import run_local
    from dflash_pipeline.steps.train.local import trainer_entry, trainers_python

    cfg = train_config(params)
    with _fail_fast():
        return run_local(s3_client(cfg.aws_conn_id), job, python=trainers_python(cfg.trainers_python),
                         entry=trainer_entry(cfg.trainer_entry), work_dir=cfg.work_dir)


def kubernetes_pod_operator(pod: dict[str, Any]) -> Any:
    """The provider's KubernetesPodOperator for one drafter's pod (kwargs from steps/train/kubernetes.pod_kwargs):
    logs streamed to the task log, the pod deleted when it succeeds (kept for a post-mortem when it fails),
    a retry reattaching to a pod a killed try left running (the provider's `durable`, its default on Airflow 3.3)."""
    from airflow.providers.cncf.kubernetes.operators.pod import KubernetesPodOperator

    return KubernetesPodOperator(task_id="train_pod", get_logs=True, on_finish_action="delete_succeeded_pod",
                                 startup_timeout_seconds=1800, do_xcom_push=False, **pod)


def train_pod(pod: dict[str, Any], context: Any) -> None:
    """Run the pod to its end; SIGTERM (the task cleared or marked failed) deletes it (the operator's on_kill)."""
    op = kubernetes_pod_operator(pod)
    with _stop_on_sigterm(op.on_kill):
        op.execute(context)


def train_cards(params: dict[str, Any], checked: dict[str, list[dict[str, Any]]],
                trained: list[dict[str, Any]] | None, run_id: str, outlet_events: Any = None) -> list[dict[str, Any]]:
    """Write each trained drafter's card last (If-None-Match); the dflash_drafter event names them all."""
    from dflash_pipeline.steps.handoff import DRAFTER_FORMAT
    from dflash_pipeline.steps.train.card import lineage, read_card, write_card

    cfg = train_config(params)
    client = s3_client(cfg.aws_conn_id)
    shards = {t["name"]: t.get("shards") for t in (trained or []) if t}
    summaries = []
    with _fail_fast():
        for job in checked["local"] + checked["kubernetes"]:
            card = write_card(client, job, shards.get(job["name"]), run_id)
            summaries.append({"name": job["name"], "card_uri": f"{job['prefix']}card.json", **lineage(card)})
        for job in checked["done"]:
            card = read_card(client, job["prefix"])
            summaries.append({"name": job["name"], "card_uri": f"{job['prefix']}card.json", **lineage(card)})
    if outlet_events is not None:
        outlet_events[drafter_asset()].extra = {"format": DRAFTER_FORMAT, "drafters": summaries}
    return summaries
