"""The generate step: one worker per server drives it and shares the dataset's chunks with the others.

``chunks`` is the chunk protocol (states, owners, S3 outcomes); ``outcomes`` turns an answer into a
row; ``worker`` is dispatch. Imports dataset/, serving/ and config; imported by tasks.py and dev/.
"""

from dflash_pipeline.steps.generate.worker import (
    OpenChunk,
    ServerBroken,
    ServerConfigError,
    ServerLost,
    TaskStopped,
    Worker,
    WorkerSettings,
    settings_for,
)

__all__ = [
    "OpenChunk", "ServerBroken", "ServerConfigError", "ServerLost", "TaskStopped", "Worker", "WorkerSettings",
    "settings_for",
]
