"""Clients of inference servers over plain HTTP: SGLang, vLLM and generic OpenAI-compatible servers (engines.py
says what differs per engine; abilities.py what each version can do).
Imports config and dataset/ only; imported by steps/ and tasks.
Knows nothing of chunks, runs or Airflow.
"""
