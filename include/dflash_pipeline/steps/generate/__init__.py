"""The generate step: one worker per server drives it and shares the dataset's chunks with the others.

``chunks`` is the chunk protocol (states, owners, S3 outcomes); ``outcomes`` turns an answer into a
row and ``conversation`` runs a unit's turns; ``worker`` is dispatch (main loop, request threads,
the stop path), with the claimer thread's half in ``claiming`` and the committer's in
``committing``; ``settings``, ``state`` and ``pool`` hold what they share. Imports dataset/,
serving/ and config; imported by tasks.py and dev/.
"""

from dflash_pipeline.steps.generate.settings import WorkerSettings, settings_for
from dflash_pipeline.steps.generate.state import OpenChunk, ServerBroken, ServerConfigError, ServerLost, TaskStopped
from dflash_pipeline.steps.generate.worker import Worker

__all__ = [
    "OpenChunk", "ServerBroken", "ServerConfigError", "ServerLost", "TaskStopped", "Worker", "WorkerSettings",
    "settings_for",
]
