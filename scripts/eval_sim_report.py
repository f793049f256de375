"""Draw docs/eval-report.png: dflash_eval's steps (prepare, each server's conditions, the report) against
moto and three simulated vLLM servers, two drafters with known per-domain acceptance and a baseline.
Prints each domain's truth (1 + sum_{i=1..k} p^i) next to the report's figure and interval.

    .venv/bin/python scripts/eval_sim_report.py docs/eval-report.png [report.md]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from dflash_pipeline.config import EvalConfig
from dflash_pipeline.dev.sim import SimConfig, SimServer
from dflash_pipeline.dev.sim.spec_drafter import true_acceptance_length
from dflash_pipeline.dev.stack import MotoServer
from dflash_pipeline.serving.sglang import ServerSpec
from dflash_pipeline.steps.evaluate import prepare, run_report, run_server

P = {"drafter-a": {"math": 0.85, "poetry": 0.45, "misc": 0.65}, "drafter-b": {"math": 0.7, "poetry": 0.3, "misc": 0.5}}
COMMON = dict(engine="vllm", length_scale=0.04, max_running_requests=8, seed=3)


def spec(p):
    return dict(spec_algorithm="draft_model", spec_num_draft_tokens=4, spec_accept_p=p["misc"],
                spec_accept_by_keyword=f"algebra={p['math']},poem={p['poetry']}", spec_per_request_metrics="summary")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("png", type=Path, help="where to write the report's acceptance figure (PNG)")
    ap.add_argument("report_md", type=Path, nargs="?", help="where to write report.md as well")
    args = ap.parse_args()
    moto = MotoServer(log_path=Path(tempfile.mkdtemp()) / "moto.log").start()
    moto.create_bucket("data")
    c = moto.client()
    servers = {"drafter-a": SimServer(SimConfig(**COMMON, **spec(P["drafter-a"]), token_time_s=0.0004)).start(),
               "drafter-b": SimServer(SimConfig(**COMMON, **spec(P["drafter-b"]), token_time_s=0.0006)).start(),
               "no-spec": SimServer(SimConfig(**COMMON, token_time_s=0.001)).start()}
    rows = []
    for i in range(60):
        rows += [{"id": f"m{i}", "domain": "math", "prompt": f"Solve this algebra problem: {i}x + {3*i} = {7*i}."},
                 {"id": f"p{i}", "domain": "poetry", "prompt": f"Write a short poem about the number {i}."},
                 {"id": f"x{i}", "domain": "misc", "prompt": f"List {i % 7 + 2} capitals, skipping the first {i}."}]
    c.put_object(Bucket="data", Key="bench/p.jsonl", Body="\n".join(json.dumps(r) for r in rows).encode())
    cfg = EvalConfig.from_params({"prompts_uri": "s3://data/bench/p.jsonl", "output_uri": "s3://data/evals/doc",
        "drafters": [{"name": n, "servers": [servers[n].url]} for n in ("drafter-a", "drafter-b")],
        "baseline": {"name": "no-spec", "servers": [servers["no-spec"].url]}, "max_tokens": 160, "concurrency": [1, "production"]})
    assignments = prepare(c, cfg, "doc", lambda s: ServerSpec(name=s, base_url=s))
    for a in assignments:
        run_server(c, cfg, a, "doc", ServerSpec(name=a["server"], base_url=a["server"]))
    report = run_report(c, cfg, assignments, "doc")
    args.png.write_bytes(c.get_object(Bucket="data", Key="evals/doc/report-acceptance.png")["Body"].read())
    if args.report_md is not None:
        args.report_md.write_text(c.get_object(Bucket="data", Key="evals/doc/report.md")["Body"].read().decode())
    head = report["headline_condition"]
    for name, ps in P.items():
        for domain, p in ps.items():
            d = report["groups"][name][head]["by_domain"][domain]
            print(f"{name} {domain}: truth {true_acceptance_length(p, 4):.3f}, reported {d['acceptance_length']:.3f} "
                  f"[{d['ci_low']:.3f}, {d['ci_high']:.3f}]")
    for s in servers.values():
        s.stop()
    moto.stop()


if __name__ == "__main__":
    main()
