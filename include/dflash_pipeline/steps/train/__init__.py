"""dflash_train's steps: check a train before any work (checks), run it (local: a subprocess in the trainers'
venv; kubernetes: the pod spec for KubernetesPodOperator), and write the drafter card last (card)."""

from dflash_pipeline.steps.train.card import CARD_FORMAT, card_key, write_card
from dflash_pipeline.steps.train.checks import TrainRefused, check_train, jobs_for
from dflash_pipeline.steps.train.local import TrainFailed, run_local

__all__ = ["CARD_FORMAT", "TrainFailed", "TrainRefused", "card_key", "check_train", "jobs_for", "run_local",
           "write_card"]
