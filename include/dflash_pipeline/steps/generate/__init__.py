"""The generate step: one worker per server drives it and shares the dataset's chunks with the others.

``worker`` holds dispatch and the chunk protocol today (see its docstring for the invariants).
Imports dataset/, serving/ and config; imported by tasks.py and dev/.
"""

from dflash_pipeline.steps.generate.worker import (
    OpenChunk,
    ServerConfigError,
    ServerLost,
    Worker,
    WorkerSettings,
    settings_for,
)

__all__ = ["OpenChunk", "ServerConfigError", "ServerLost", "Worker", "WorkerSettings", "settings_for"]
