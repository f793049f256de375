"""validate_and_count: is every planned prompt present exactly once, and what did we get?

``run`` drives it (stream chunks, check, write the report); ``checks`` holds the per-row checks,
``tally`` what they count, ``report`` thresholds and report.json / report.md, ``tokencount`` the
recount with the training tokenizer, ``histogram`` and ``plots`` the figures. Imports dataset/ and
config only (tasks.py and dev/ import it).
"""

from dflash_pipeline.steps.validate.checks import Validator
from dflash_pipeline.steps.validate.report import Thresholds, build_report, evaluate, report_markdown
from dflash_pipeline.steps.validate.run import ValidationFailed, run_validation
from dflash_pipeline.steps.validate.tally import LIST_LIMIT, Tally

__all__ = [
    "LIST_LIMIT",
    "Tally",
    "Thresholds",
    "ValidationFailed",
    "Validator",
    "build_report",
    "evaluate",
    "report_markdown",
    "run_validation",
]
