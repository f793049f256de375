"""dflash_eval: measure drafters (groups of servers with a speculative configuration) on held-out or
benchmark prompts, through the generate step's own dispatch.

``prepare`` finds the prompts and plans + preflights one generate dataset per (group, condition);
``run`` drives one server through its group's conditions with the generate Worker and scrapes its
``/metrics`` around each (``metrics``); ``figures`` is the arithmetic (acceptance via
serving/specstats.py, throughput, the cross-check, the ranking); ``report`` reads the datasets and
writes report.json/.md with ``render`` and ``plots``. Imports config, dataset/, serving/, monitor/
and steps.generate/plan/preflight; imported by tasks.py.
"""

from dflash_pipeline.steps.evaluate.prepare import prepare, resolve_prompts
from dflash_pipeline.steps.evaluate.report import EvalFailed, EvalIncomplete, run_report
from dflash_pipeline.steps.evaluate.run import run_server

__all__ = ["EvalFailed", "EvalIncomplete", "prepare", "resolve_prompts", "run_report", "run_server"]
