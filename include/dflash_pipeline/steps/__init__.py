"""The pipeline's steps, one module or package each: plan, preflight, generate, validate, handoff.

Plain, typed functions; tasks.py wraps each in an Airflow task. Imports config, dataset/, serving/
and monitor/; imported by tasks and dev/ only.
"""
