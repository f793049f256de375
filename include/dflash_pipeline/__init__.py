"""dflash-pipeline: regenerate drafter training data with a fleet of inference servers.

Layers, bottom to top (a module imports only its own layer or lower ones; tests/integrity/test_layering.py
checks it from the AST):

* ``config`` (the params' schemas, RunConfig) and ``dataset/`` (S3 layout, store, records, prompts)
* ``serving/`` (clients of inference servers) and ``monitor/`` (progress, the plugin's pages)
* ``steps/`` (plan, preflight, generate, validate, handoff)
* ``tasks`` (the only module that imports Airflow)

``dev/`` (local stack, simulator, fault lab, S3 server) may import anything; nothing in the package
imports it, only tests, benches, scripts and the demo.
"""

from __future__ import annotations

__version__ = "0.1.0"
