"""dflash_tokenize: validated completions → token-exact training rows + SpecForge conversations JSONL.

``turns`` finds each row's regenerated assistant turns and the context each request carried;
``exact`` builds one training row per turn from the engine's own token ids (or re-encodes and
checks the text when the engine gave none), loss only on what the model generated; ``run`` plans
the parts per worker, writes each part's outputs exactly once, and sums the report. Imports
dataset/, config and the recount's tokenizer loading (steps.validate.tokencount); tasks.py and
dev/ import it.
"""

from dflash_pipeline.steps.tokenize.exact import (
    TOKENIZED_SCHEMA,
    PartStats,
    TokenizeSettings,
    TrainingRowBuilder,
    tokenize_table,
)
from dflash_pipeline.steps.tokenize.run import (
    TokenizeFailed,
    build_report,
    load_tokenizer,
    plan,
    run_assignment,
    write_report,
)
from dflash_pipeline.steps.tokenize.turns import TurnSource, turns_of

__all__ = [
    "TOKENIZED_SCHEMA",
    "PartStats",
    "TokenizeFailed",
    "TokenizeSettings",
    "TrainingRowBuilder",
    "TurnSource",
    "build_report",
    "load_tokenizer",
    "plan",
    "run_assignment",
    "tokenize_table",
    "turns_of",
    "write_report",
]
