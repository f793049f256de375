"""Quality signals of the completions (issue 32): per-row signals (`signals`), near-duplicate prompts
(`near_dup`), and their counts in the validation report (`tally`). Imports config and dataset only; the
validate and tokenize steps import it.
"""

from dflash_pipeline.config.quality import QUALITY_PARAM_SCHEMAS, QualitySettings
from dflash_pipeline.steps.quality.signals import QUALITY_FLAGS, SIGNAL_COLUMNS, flags_of, row_signals

__all__ = ["QUALITY_FLAGS", "QUALITY_PARAM_SCHEMAS", "SIGNAL_COLUMNS", "QualitySettings", "flags_of", "row_signals"]
