"""The generate step: one worker per server drives it and shares the dataset's chunks with the others.

``chunks`` is the chunk protocol (states, owners, S3 outcomes, the renewer); ``worker`` is main's
thread (dispatch, hand-offs, the stop). Each piece of shared state has one owner object:
``ledger`` (where each chunk is), ``claiming`` (the claimer thread), ``committing`` (the
committer thread), ``scan`` (what S3 says is done), ``failing`` (is the server failing, its
probe), ``handback`` (partial writes and hand-backs), ``breaker``. ``requesting`` runs one unit on
a request thread (``conversation`` has the turn rules, ``outcomes`` turns an answer into a row);
``snapshot`` is the progress document; ``settings``, ``state`` and ``pool`` hold what they share.
Imports dataset/, serving/ and config; imported by tasks.py and dev/.
"""

from dflash_pipeline.steps.generate.settings import WorkerSettings, settings_for
from dflash_pipeline.steps.generate.state import (
    OpenChunk,
    ServerBroken,
    ServerConfigError,
    ServerLost,
    TaskStopped,
)
from dflash_pipeline.steps.generate.worker import Worker

__all__ = [
    "OpenChunk", "ServerBroken", "ServerConfigError", "ServerLost", "TaskStopped", "Worker", "WorkerSettings",
    "settings_for",
]
