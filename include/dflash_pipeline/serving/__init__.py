"""Clients of inference servers (SGLang's OpenAI-compatible dialect today), over plain HTTP.

Imports config and dataset/ only; imported by steps/ and tasks.
Knows nothing of chunks, runs or Airflow.
"""
