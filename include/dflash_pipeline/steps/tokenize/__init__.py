"""dflash_tokenize: validated completions → loss-masked token shards + SpecForge conversations JSONL.

``masks`` renders and encodes conversations (input_ids, loss_mask); ``run`` plans the parts per
worker, writes each part's outputs exactly once, and sums the report. Imports dataset/, config and
the recount's tokenizer loading (steps.validate.tokencount); tasks.py and dev/ import it.
"""

from dflash_pipeline.steps.tokenize.masks import (
    TOKENIZED_SCHEMA,
    ConversationTokenizer,
    PartStats,
    TokenizeSettings,
    Turn,
    conversation_of,
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

__all__ = [
    "TOKENIZED_SCHEMA",
    "ConversationTokenizer",
    "PartStats",
    "TokenizeFailed",
    "TokenizeSettings",
    "Turn",
    "build_report",
    "conversation_of",
    "load_tokenizer",
    "plan",
    "run_assignment",
    "tokenize_table",
    "write_report",
]
