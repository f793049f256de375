"""dflash-pipeline: regenerate drafter training data with a fleet of SGLang servers."""

from __future__ import annotations

__version__ = "0.1.0"
