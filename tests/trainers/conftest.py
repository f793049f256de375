"""tests/trainers: the trainers' own loaders on files our profile functions wrote.

The fixtures (``trainers_python``, ``run_loaders``) live in tests/conftest.py: tests/engine's end-to-end
test runs the same loaders on what the DAG wrote.
"""
