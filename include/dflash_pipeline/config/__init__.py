"""The run's configuration: the DAG params' JSON schemas and the typed configs built from them.

`run` holds dflash_generate's params (RunConfig, Sampling) and the schema checks; `tokenize` holds
dflash_tokenize's (TokenizeConfig, the trainer-facing params); `evaluate` holds dflash_eval's
(EvalConfig: drafter groups, conditions, the RunConfig each condition is generated with). Everything is re-exported here, so
callers import from `dflash_pipeline.config`.
"""

from dflash_pipeline.config.evaluate import (
    EVAL_PARAM_SCHEMAS,
    Condition,
    EvalConfig,
    Group,
)
from dflash_pipeline.config.run import (
    PARAM_SCHEMAS,
    REQUIRED_PARAMS,
    SECTION_DATA,
    SECTION_RUN,
    SECTION_SAMPLING,
    SECTION_SERVERS,
    SECTION_VALIDATION,
    ConfigError,
    RunConfig,
    Sampling,
    short_server_labels,
)
from dflash_pipeline.config.tokenize import (
    DEFAULT_FORMATS,
    DFLASH_MIN_LOSS_TOKENS,
    SECTION_TOKENIZE,
    TOKENIZE_PARAM_SCHEMAS,
    TOKENIZE_PROFILES,
    TRAINER_PARAM_SCHEMAS,
    TokenizeConfig,
)

__all__ = [
    "EVAL_PARAM_SCHEMAS", "Condition", "EvalConfig", "Group",
    "DEFAULT_FORMATS", "DFLASH_MIN_LOSS_TOKENS", "PARAM_SCHEMAS", "REQUIRED_PARAMS", "SECTION_DATA", "SECTION_RUN", "SECTION_SAMPLING",
    "SECTION_SERVERS", "SECTION_TOKENIZE", "SECTION_VALIDATION", "TOKENIZE_PARAM_SCHEMAS", "TOKENIZE_PROFILES",
    "TRAINER_PARAM_SCHEMAS", "ConfigError", "RunConfig", "Sampling", "TokenizeConfig", "short_server_labels",
]
