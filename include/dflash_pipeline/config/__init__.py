"""The run's configuration: the DAG params' JSON schemas and the typed configs built from them.

`run` holds dflash_generate's params (RunConfig, Sampling) and the schema checks; `tokenize` holds
dflash_tokenize's (TokenizeConfig, the trainer-facing params); `evaluate` holds dflash_eval's
(EvalConfig: drafter groups, conditions, the RunConfig each condition is generated with). Everything is re-exported here, so
callers import from `dflash_pipeline.config`.
"""

from dflash_pipeline.config.evaluate import (
    EVAL_ESSENTIAL_PARAMS,
    EVAL_PARAM_SCHEMAS,
    Condition,
    EvalConfig,
    Group,
)
from dflash_pipeline.config.run import (
    ADVANCED_PREFIX,
    ESSENTIAL_PARAMS,
    ESSENTIALS_SECTION,
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
    form_layout,
    short_server_labels,
)
from dflash_pipeline.config.tokenize import (
    DEFAULT_FORMATS,
    DFLASH_MIN_LOSS_TOKENS,
    SECTION_TOKENIZE,
    TOKENIZE_ESSENTIAL_PARAMS,
    TOKENIZE_PARAM_SCHEMAS,
    TOKENIZE_PROFILES,
    TRAINER_PARAM_SCHEMAS,
    TokenizeConfig,
)
from dflash_pipeline.config.train import (
    TRAIN_ESSENTIAL_PARAMS,
    TRAIN_PARAM_SCHEMAS,
    TrainConfig,
)

__all__ = [
    "TRAIN_ESSENTIAL_PARAMS", "TRAIN_PARAM_SCHEMAS", "TrainConfig",
    "ADVANCED_PREFIX", "ESSENTIAL_PARAMS", "ESSENTIALS_SECTION", "EVAL_ESSENTIAL_PARAMS", "TOKENIZE_ESSENTIAL_PARAMS",
    "form_layout",
    "EVAL_PARAM_SCHEMAS", "Condition", "EvalConfig", "Group",
    "DEFAULT_FORMATS", "DFLASH_MIN_LOSS_TOKENS", "PARAM_SCHEMAS", "REQUIRED_PARAMS", "SECTION_DATA", "SECTION_RUN", "SECTION_SAMPLING",
    "SECTION_SERVERS", "SECTION_TOKENIZE", "SECTION_VALIDATION", "TOKENIZE_PARAM_SCHEMAS", "TOKENIZE_PROFILES",
    "TRAINER_PARAM_SCHEMAS", "ConfigError", "RunConfig", "Sampling", "TokenizeConfig", "short_server_labels",
]
