"""The loop users take on faith, run by the pipeline's own steps on CPU (issue 38 items 3 and 4).

From one prompt set with original answers (:mod:`topic_qwen`'s prompts, the learnable tiny target):

1. the target is served on real vLLM 0.32 CPU and the prompts are regenerated through the pipeline's own
   steps against a real S3 protocol server: plan with a held-out split and a thinking mix (on and off), the
   generate worker (``dev/faultlab.run_generation``: plan + preflight + one Worker, like a DAG run),
   validation;
2. tokenized twice by the tokenize steps: (a) the regenerated answers (``default``), (b) ``answers:
   original`` (tokenization ``original``); with ``sensitivity``, (a) broken by ``dev/data_defects.py``
   (``shifted_loss_mask``, ``thinking_off_as_on``: named tokenizations derived from ``default``);
3. each trained by dflash_train's local backend (``steps/train``: check, claim, ``run_local`` running
   ``specforge_entry.py`` in .venv-trainers, card) with the same trainer, steps and seed; (c) is
   ``dflash_drafter.build_untrained`` with the trained drafters' architecture, given a card that says so;
4. each drafter downloaded from its card's folder, served with vLLM's DFlash path (``dflash_spec``, k = block
   size - 1; at most ``max_servers`` servers up at once, each round measured into the same eval root), and all
   measured by dflash_eval's steps (prepare, run_server per server, report) on the
   dataset's held-out prompts, greedy and sampled, thinking on and off, the drafter groups naming their cards
   (``card_uri``): the report carries each drafter's lineage, its acceptance with an interval and the paired
   differences with intervals.

Plain typed functions (dev tooling): the CI test (tests/engine/test_loop.py) and the bench
(bench/loop_bench.py) call :func:`run_loop`; :func:`summarize` is what both print.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipeline.config import EvalConfig, RunConfig, TokenizeConfig, TrainConfig
from dflash_pipeline.dataset.layout import DEFAULT_TOKENIZATION, DatasetLayout, parse_s3_uri
from dflash_pipeline.dataset.store import Store, upload_file
from dflash_pipeline.dev.engine import dflash_drafter, topic_qwen
from dflash_pipeline.dev.stack.vllm_server import VllmServer, VllmSettings, dflash_spec
from dflash_pipeline.serving.sglang import ServerSpec

logger = logging.getLogger(__name__)

REGENERATED = "regenerated"
ORIGINAL = "original"
UNTRAINED = "untrained"
DEFECTS = ("shifted_loss_mask", "thinking_off_as_on")
UNTRAINED_TRAINER = "none (untrained: dev/engine/dflash_drafter.build_untrained)"


@dataclass(frozen=True)
class LoopSettings:
    """Sizes of one loop run (the CI test takes the defaults; the bench may take more)."""

    prompts: int = 160
    heldout_fraction: float = 0.25
    thinking_fraction: float = 0.5
    gen_max_tokens: int = 64
    steps: int = 100
    batch_size: int = 4
    learning_rate: float = 3e-3
    block_size: int = 4  # k = 3 drafted tokens per verify step
    num_draft_layers: int = 1
    max_length: int = 512
    seed: int = 0
    eval_max_tokens: int = 64
    eval_max_prompts: int | None = None
    greedy: bool = True
    sampled: bool = True
    thinking_modes: tuple[str, ...] = ("on", "off")
    concurrency: int = 4
    sensitivity: tuple[str, ...] = ()
    start_timeout_s: float = 600.0
    max_servers: int = 3  # vLLM DFlash servers up at once (each ~2.7 GB resident on CPU)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.sensitivity) - set(DEFECTS))
        if unknown:
            raise ValueError(f"unknown defect(s) {unknown}; known: {list(DEFECTS)}")
        if not (self.greedy or self.sampled):
            raise ValueError("measure greedy, sampled or both")


@dataclass
class LoopResult:
    """What one loop run produced: where everything is, the timings, the eval report and its summary."""

    dataset_uri: str
    cards: dict[str, str]  # drafter -> card uri
    train: dict[str, dict[str, Any]]  # drafter -> trainer figures (wall_s, rows_per_s, rows, steps, final loss)
    tokenizations: dict[str, dict[str, Any]]  # drafter -> its tokenization's figures
    timings: dict[str, float]
    report: dict[str, Any]
    summary: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------- data


def write_inputs(client: Any, bucket: str, root: str, work: Path, settings: LoopSettings,
                 tokenizer_source: Path | None = None) -> tuple[Path, str]:
    """The topic target's checkpoint (local) and its prompts with original answers (on S3)."""
    target = topic_qwen.build_checkpoint(work / "target", tokenizer_source=tokenizer_source)
    rows = topic_qwen.prompt_rows(settings.prompts, seed=settings.seed)
    key = f"{root}/prompts.jsonl"
    client.put_object(Bucket=bucket, Key=key, Body="".join(json.dumps(r) + "\n" for r in rows).encode())
    return target, f"s3://{bucket}/{key}"


def generation_params(prompts_uri: str, output_uri: str, server_url: str, target: Path,
                      settings: LoopSettings) -> dict[str, Any]:
    """dflash_generate's params of the regeneration (production sampling, a held-out split, a thinking mix)."""
    return {"prompts_uri": prompts_uri, "output_uri": output_uri, "servers": [server_url],
            "model": topic_qwen.MODEL_NAME, "max_tokens": settings.gen_max_tokens, "seed": settings.seed,
            "tokenizer": str(target), "heldout_fraction": settings.heldout_fraction,
            "thinking_fraction": settings.thinking_fraction, "save_every": 40}


def regenerate(client: Any, params: dict[str, Any], run_id: str = "loop-generate") -> dict[str, Any]:
    """Plan, preflight, the generate worker, validation (the steps a dflash_generate run runs); the validation
    report. Raises what the steps raise (a failed worker, ValidationFailed)."""
    from dflash_pipeline.config.quality import QualitySettings
    from dflash_pipeline.dev.faultlab import run_generation
    from dflash_pipeline.steps.validate import Thresholds, run_validation

    cfg = RunConfig.from_params(params)
    outs = run_generation(client, cfg, list(cfg.servers), run_id)
    for out in outs:
        if isinstance(out, BaseException):
            raise RuntimeError(f"the generate worker failed: {out!r}") from out
    thresholds = Thresholds(max_error_rate=cfg.max_error_rate, max_truncation_rate=cfg.max_truncation_rate,
                            min_coverage=cfg.min_coverage, max_missing_reasoning_rate=cfg.max_missing_reasoning_rate,
                            max_loop_rate=cfg.max_loop_rate)
    report: dict[str, Any] = run_validation(client, cfg.output_uri, thresholds=thresholds, tokenizer=cfg.tokenizer,
                                            plots=False, quality=QualitySettings.from_params(params))
    logger.info("regenerated %s: %d completions, %d errors, %d truncated", cfg.output_uri, report["completions"],
                report["errors"], report["truncated"])
    return report


def tokenize(client: Any, dataset_uri: str, *, tokenization: str | None = None, answers: str = REGENERATED,
             max_length: int = 512) -> dict[str, Any]:
    """The tokenize steps (plan, every assignment, report) for one tokenization; its report."""
    from dflash_pipeline.steps.tokenize import plan, run_assignment, write_report

    params: dict[str, Any] = {"output_uri": dataset_uri, "max_length": max_length, "answers": answers}
    if tokenization:
        params["tokenization"] = tokenization
    cfg = TokenizeConfig.from_params(params)
    planned = plan(client, [dataset_uri], cfg)
    for assignment in planned["assignments"]:
        run_assignment(client, assignment)
    [dataset] = planned["datasets"]
    report: dict[str, Any] = write_report(client, dataset, cfg.min_kept_share)
    logger.info("tokenization %r of %s: %s rows out, %s dropped", report.get("tokenization"), dataset_uri,
                report.get("rows_out"), report.get("rows_dropped"))
    return report


def plant(client: Any, dataset_uri: str, defect: str) -> dict[str, Any]:
    """Tokenization ``default-<defect>``: the regenerated one with `defect` planted (dev/data_defects.py)."""
    from dflash_pipeline.dev.data_defects import plant_defect

    return plant_defect(client, dataset_uri, defect)


# ---------------------------------------------------------------------------------------------- drafters


def train_params(dataset_uri: str, tokenization: str, name: str, drafters_root: str, target: Path,
                 settings: LoopSettings, work_dir: Path) -> dict[str, Any]:
    """dflash_train's params (local backend): the same trainer, steps, seed and hyperparameters for every drafter."""
    return {"dataset_uri": dataset_uri, "tokenization": tokenization, "drafter_name": name,
            "drafters_root": drafters_root, "target_model": str(target), "backend": "local",
            "steps": settings.steps, "seed": settings.seed, "learning_rate": settings.learning_rate,
            "batch_size": settings.batch_size, "max_length": settings.max_length, "block_size": settings.block_size,
            "num_draft_layers": settings.num_draft_layers, "save_every": settings.steps, "work_dir": str(work_dir)}


def train(client: Any, params: dict[str, Any], run_id: str = "loop-train") -> tuple[str, dict[str, Any]]:
    """dflash_train's local route for one drafter: check (refuses before any work), claim, run the trainer,
    write the card last. Returns (card uri, card)."""
    from dflash_pipeline.steps.train.card import write_card
    from dflash_pipeline.steps.train.checks import check_train, claim_job
    from dflash_pipeline.steps.train.local import run_local, trainer_entry, trainers_python

    cfg = TrainConfig.from_params(params)
    assert cfg.dataset_uri is not None
    job = claim_job(client, check_train(client, cfg, cfg.dataset_uri, cfg.tokenization))
    shards = None
    if job["status"] != "done":
        trained = run_local(client, job, python=trainers_python(cfg.trainers_python),
                            entry=trainer_entry(cfg.trainer_entry), work_dir=cfg.work_dir)
        shards = trained["shards"]
    card = write_card(client, job, shards, run_id)
    return f"{job['prefix']}card.json", card


def download_drafter(client: Any, card: Mapping[str, Any], dest: Path) -> Path:
    """The drafter's files (``drafter/*`` under its card's folder) into `dest`: what is served is what the card names."""
    loc = parse_s3_uri(str(card["uri"]).rstrip("/"), what="drafter uri")
    prefix = f"{loc.key}/drafter/"
    keys = [k for k in card["files"] if k.startswith(prefix)]
    if not keys:
        raise RuntimeError(f"{card['uri']}: the card lists no drafter file")
    for key in keys:
        path = dest / key[len(prefix):]
        path.parent.mkdir(parents=True, exist_ok=True)
        client.download_file(loc.bucket, key, str(path))
    return dest


ARCHITECTURE_KEYS = ("architectures", "num_hidden_layers", "block_size", "dflash_config", "hidden_size",
                     "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim", "vocab_size",
                     "num_target_layers")


def untrained(client: Any, target: Path, like: Path, drafters_root: str, settings: LoopSettings,
              work: Path, dataset_uri: str, run_id: str = "loop-train") -> tuple[str, dict[str, Any], Path]:
    """(c): ``build_untrained`` with the architecture of the trained drafter at `like` (same layers, block size,
    target layers, mask token; seed = the trainers' seed), uploaded beside the trained ones with a card whose
    trainer says 'untrained' and whose training is 0 steps. Returns (card uri, card, local drafter dir)."""
    from dflash_pipeline.steps.train.card import CARD_FORMAT, card_key

    out = dflash_drafter.build_untrained(target, work / UNTRAINED, layers=settings.num_draft_layers,
                                         block_size=settings.block_size, seed=settings.seed)
    mine, theirs = dflash_drafter.read_config(out), dflash_drafter.read_config(like)
    differ = {k: (mine.get(k), theirs.get(k)) for k in ARCHITECTURE_KEYS if mine.get(k) != theirs.get(k)}
    if differ:
        raise RuntimeError(f"the untrained drafter's architecture differs from the trained one's: {differ}")
    loc = parse_s3_uri(drafters_root.rstrip("/") + f"/{UNTRAINED}", what="drafters_root")
    store = Store(client, loc.bucket)
    files: dict[str, Any] = {}
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        key = f"{loc.key}/drafter/{path.relative_to(out).as_posix()}"
        with path.open("rb") as fh:
            upload_file(store, key, fh, "application/json" if path.suffix == ".json" else "application/octet-stream")
        files[key] = {"size": path.stat().st_size}
    prefix = f"s3://{loc.bucket}/{loc.key}/"
    hyper = {"steps": 0, "seed": settings.seed, "block_size": settings.block_size,
             "num_draft_layers": settings.num_draft_layers}
    card = {"format": CARD_FORMAT, "name": UNTRAINED, "uri": prefix, "settings_hash": None,
            "settings": {"untrained": True, "architecture_of": str(like)},
            "dataset": {"uri": None, "note": f"none: trained on nothing (the loop's dataset is {dataset_uri})"},
            "tokenization": {"name": None, "answers": None}, "shards": [], "heldout": None,
            "target_model": str(target), "backend": "none",
            "trainer": {"name": UNTRAINED_TRAINER, "version": None}, "hyperparameters": hyper, "save_every": None,
            "training": {"steps": 0, "loss": [], "rows": 0, "tokens": 0, "wall_s": 0.0, "rows_per_s": None,
                         "resumed_from_step": None},
            "files": files, "created_by_run": run_id}
    store.put(card_key(loc.key), json.dumps(card, indent=1, sort_keys=True).encode(), content_type="application/json")
    return f"{prefix}card.json", card, out


@contextmanager
def serve_drafters(target: Path, drafters: Mapping[str, Path], work: Path, k: int,
                   timeout_s: float = 600.0) -> Iterator[dict[str, VllmServer]]:
    """One ``vllm serve`` of the target per drafter, speculating with vLLM's DFlash path (k drafted tokens), all
    started at once (start-up is mostly waiting) and stopped at the end."""
    servers = {name: VllmServer(target, VllmSettings(served_model_name=topic_qwen.MODEL_NAME,
                                                     speculative_config=dflash_spec(path, k)),
                                workdir=work / f"vllm-{name}")
               for name, path in drafters.items()}
    errors: dict[str, BaseException] = {}

    def start(name: str) -> None:
        try:
            servers[name].start(timeout_s=timeout_s)
        except BaseException as exc:  # noqa: BLE001 - raised below, after every start ended
            errors[name] = exc

    threads = [threading.Thread(target=start, args=(n,), name=f"vllm-{n}") for n in servers]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise RuntimeError(f"vLLM DFlash server(s) did not start: {errors}")
        yield servers
    finally:
        for s in servers.values():
            s.stop()


# ---------------------------------------------------------------------------------------------- eval


def eval_params(dataset_uri: str, output_uri: str, groups: Mapping[str, tuple[str, str]],
                settings: LoopSettings) -> dict[str, Any]:
    """dflash_eval's params: the dataset's held-out prompts, one group per drafter naming its card."""
    params: dict[str, Any] = {
        "dataset_uri": dataset_uri, "output_uri": output_uri,
        "drafters": [{"name": n, "servers": [url], "card_uri": card} for n, (url, card) in groups.items()],
        "model": topic_qwen.MODEL_NAME, "max_tokens": settings.eval_max_tokens, "greedy": settings.greedy,
        "thinking_modes": list(settings.thinking_modes), "concurrency": [settings.concurrency], "save_every": 20}
    if not settings.sampled:
        params["temperature"] = 0.0  # only greedy conditions: EvalConfig names them
    if settings.eval_max_prompts:
        params["max_prompts"] = settings.eval_max_prompts
    return params


def measure(client: Any, params: dict[str, Any], run_id: str) -> list[dict[str, Any]]:
    """dflash_eval's prepare and run_server (every server at once, as the mapped task) for the groups in
    `params` (the servers must be up); the assignments, for :func:`eval_report`."""
    from dflash_pipeline.steps.evaluate import prepare, run_server

    cfg = EvalConfig.from_params(params)
    assignments = prepare(client, cfg, run_id, lambda url: ServerSpec(name=url, base_url=url))
    errors: list[BaseException] = []

    def one(a: dict[str, Any]) -> None:
        try:
            run_server(client, cfg, a, run_id, ServerSpec(name=a["server"], base_url=a["server"]))
        except BaseException as exc:  # noqa: BLE001 - raised below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(a,), name=f"eval-{a['group']}") for a in assignments]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise RuntimeError(f"eval server task(s) failed: {errors!r}")
    return assignments


def eval_report(client: Any, params: dict[str, Any], assignments: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    """dflash_eval's report over every group of `params` (their datasets written by :func:`measure`)."""
    from dflash_pipeline.steps.evaluate import run_report

    out: dict[str, Any] = run_report(client, EvalConfig.from_params(params), assignments, run_id, plots=False)
    return out


def evaluate_in_rounds(client: Any, target: Path, drafters: Mapping[str, Path], cards: Mapping[str, str],
                       dataset_uri: str, eval_uri: str, work: Path, settings: LoopSettings,
                       run_id: str = "loop-eval") -> tuple[dict[str, Any], float]:
    """Every drafter measured by dflash_eval on its own DFlash server, at most `settings.max_servers` servers up
    at once (memory): each round prepares and runs its groups into the same eval root (each (group, condition)
    is its own dataset there), then one report over all groups. Returns (report, seconds spent starting)."""
    names = list(drafters)
    groups: dict[str, tuple[str, str]] = {}
    assignments: list[dict[str, Any]] = []
    starting = 0.0
    for i in range(0, len(names), settings.max_servers):
        batch = {n: drafters[n] for n in names[i:i + settings.max_servers]}
        t = time.monotonic()
        with serve_drafters(target, batch, work, k=settings.block_size - 1,
                            timeout_s=settings.start_timeout_s) as servers:
            starting += time.monotonic() - t
            mine = {n: (s.base_url, cards[n]) for n, s in servers.items()}
            groups.update(mine)
            assignments += measure(client, eval_params(dataset_uri, eval_uri, mine, settings),
                                   f"{run_id}-{i // settings.max_servers}")
    return eval_report(client, eval_params(dataset_uri, eval_uri, groups, settings), assignments, run_id), starting


def summarize(report: Mapping[str, Any], reference: str = REGENERATED) -> dict[str, Any]:
    """Per condition: each drafter's acceptance length and interval, and `reference` minus each other drafter
    (the report's paired difference on common prompts, its interval, and whether it excludes 0)."""
    out: dict[str, Any] = {"conditions": {}, "lineage": {}}
    for name, lin in (report.get("lineage") or {}).items():
        out["lineage"][name] = {k: lin.get(k) for k in ("dataset", "tokenization", "answers", "defect", "trainer",
                                                          "trainer_version", "steps", "seed", "final_loss")}
    for cond in [c["name"] for c in report.get("conditions") or []]:
        figs = {}
        for name, per_cond in (report.get("groups") or {}).items():
            acc = ((per_cond.get(cond) or {}).get("acceptance") or {})
            figs[name] = {"acceptance_length": acc.get("acceptance_length"), "ci": [acc.get("ci_low"),
                                                                                     acc.get("ci_high")],
                          "rows": acc.get("rows_with_stats")}
        diffs = {}
        for p in (report.get("paired") or {}).get(cond) or []:
            if reference not in (p["a"], p["b"]):
                continue
            sign = 1.0 if p["a"] == reference else -1.0
            other = p["b"] if p["a"] == reference else p["a"]
            lo, hi = p.get("ci_low"), p.get("ci_high")
            ci = None if lo is None or hi is None else sorted([sign * lo, sign * hi])
            diff = None if p.get("difference") is None else sign * p["difference"]
            diffs[other] = {"difference": diff, "ci": ci, "prompts": p.get("prompts"),
                            "excludes_0": None if ci is None else not (ci[0] <= 0.0 <= ci[1])}
        ranking = [e["drafter"] for e in (report.get("rankings") or {}).get(cond) or []]
        out["conditions"][cond] = {"acceptance": figs, f"{reference}_minus": diffs, "ranking": ranking}
    return out


# ---------------------------------------------------------------------------------------------- the loop


def run_loop(client: Any, bucket: str, work: Path, settings: LoopSettings = LoopSettings(), *,
             root: str = "loop", tokenizer_source: Path | None = None) -> LoopResult:
    """The whole experiment (module docstring). Servers it starts are stopped before it returns."""
    timings: dict[str, float] = {}
    t0 = time.monotonic()
    work.mkdir(parents=True, exist_ok=True)
    target, prompts_uri = write_inputs(client, bucket, root, work, settings, tokenizer_source)
    dataset_uri = f"s3://{bucket}/{root}/dataset"
    drafters_root = f"s3://{bucket}/{root}/drafters"

    t = time.monotonic()
    with VllmServer(target, VllmSettings(served_model_name=topic_qwen.MODEL_NAME),
                    workdir=work / "vllm-target").start(timeout_s=settings.start_timeout_s) as server:
        timings["target_server_start_s"] = server.started_in_s or 0.0
        regenerate(client, generation_params(prompts_uri, dataset_uri, server.base_url, target, settings))
    timings["generate_s"] = time.monotonic() - t

    t = time.monotonic()
    tokenizations = {REGENERATED: tokenize(client, dataset_uri, max_length=settings.max_length),
                     ORIGINAL: tokenize(client, dataset_uri, tokenization=ORIGINAL, answers=ORIGINAL,
                                        max_length=settings.max_length)}
    names = {REGENERATED: DEFAULT_TOKENIZATION, ORIGINAL: ORIGINAL}
    for defect in settings.sensitivity:
        tokenizations[defect] = plant(client, dataset_uri, defect)
        names[defect] = f"{DEFAULT_TOKENIZATION}-{defect}"
    timings["tokenize_s"] = time.monotonic() - t

    cards: dict[str, str] = {}
    train_figs: dict[str, dict[str, Any]] = {}
    local: dict[str, Path] = {}
    for drafter, tokenization in names.items():
        t = time.monotonic()
        card_uri, card = train(client, train_params(dataset_uri, tokenization, drafter.replace("_", "-"),
                                                    drafters_root, target, settings, work / "train"))
        cards[drafter] = card_uri
        training = card.get("training") or {}
        loss = training.get("loss") or []
        train_figs[drafter] = {"wall_s": training.get("wall_s"), "rows_per_s": training.get("rows_per_s"),
                               "rows": training.get("rows"), "tokens": training.get("tokens"),
                               "steps": training.get("steps"), "loss_first": loss[0][1] if loss else None,
                               "loss_last": loss[-1][1] if loss else None, "step_wall_s": time.monotonic() - t}
        local[drafter] = download_drafter(client, card, work / "served" / drafter)
    card_uri, _, local[UNTRAINED] = untrained(client, target, local[REGENERATED], drafters_root, settings,
                                              work / "served", dataset_uri)
    cards[UNTRAINED] = card_uri
    timings["train_s"] = sum(f["step_wall_s"] for f in train_figs.values())

    t = time.monotonic()
    report_doc, timings["drafter_servers_start_s"] = evaluate_in_rounds(
        client, target, local, cards, dataset_uri, f"s3://{bucket}/{root}/eval", work, settings)
    timings["eval_s"] = time.monotonic() - t - timings["drafter_servers_start_s"]
    timings["total_s"] = time.monotonic() - t0
    tok_figs = {d: {k: r.get(k) for k in ("tokenization", "answers", "rows_out", "rows_dropped", "tokens",
                                          "loss_tokens")} for d, r in tokenizations.items()}
    return LoopResult(dataset_uri, cards, train_figs, tok_figs, {k: round(v, 1) for k, v in timings.items()},
                      report_doc, summarize(report_doc), asdict(settings))


def report_markdown(client: Any, eval_uri: str) -> str:
    """The eval's own report.md (written by run_report at the eval root `eval_uri`)."""
    layout = DatasetLayout.from_uri(eval_uri)
    got = Store(client, layout.bucket).get(layout.key("report.md"))
    return "" if got is None else got[0].decode()


def format_table(result: LoopResult, drafters: Sequence[str] | None = None) -> str:
    """Side by side: per condition each drafter's acceptance [interval] and regenerated minus it [interval]."""
    names = list(drafters or result.summary["conditions"][next(iter(result.summary["conditions"]))]["acceptance"])
    lines = ["| condition | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for cond, c in result.summary["conditions"].items():
        cells = []
        for n in names:
            a = c["acceptance"].get(n) or {}
            ci = a.get("ci") or [None, None]
            cell = f"{a.get('acceptance_length')} [{ci[0]}, {ci[1]}]"
            d = c[f"{REGENERATED}_minus"].get(n)
            if d and d["difference"] is not None:
                dci = d["ci"] or [None, None]
                cell += f"; a-{n}: {d['difference']:+.3f} [{dci[0]}, {dci[1]}]"
            cells.append(cell)
        lines.append(f"| {cond} | " + " | ".join(cells) + " |")
    return "\n".join(lines)
