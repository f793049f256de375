"""dflash_tokenize's params: their JSON schemas (the DAG's Params) and the checked TokenizeConfig."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dflash_pipeline.config.mix import check_target_mix, target_mix_schema
from dflash_pipeline.config.quality import QUALITY_PARAM_SCHEMAS
from dflash_pipeline.config.run import SECTION_DATA, SECTION_RUN, ConfigError, _check_schema
from dflash_pipeline.dataset.layout import (
    DEFAULT_TOKENIZATION,
    TOKENIZATION_NAME_RE,
    TOKENIZED_RESERVED,
    UriError,
    parse_s3_uri,
)


SECTION_TOKENIZE = "Tokenize"

TOKENIZE_PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "output_uri": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "Manual runs: s3://bucket/prefix of a validated dataset root to tokenize. Runs queued "
        "by the dflash_completions asset take the dataset from the event and ignore this.",
        "section": SECTION_DATA,
    },
    "tokenizer": {
        "type": ["null", "string"],
        "default": None,
        "description": "The training tokenizer: a Hugging Face id (through the hub cache), a local tokenizer.json "
        "or model directory, s3://bucket/path/tokenizer.json, or an s3:// prefix holding tokenizer.json (+ "
        "tokenizer_config.json with the chat template). Null = the generate run's (recorded in its manifest at "
        "plan; a Hugging Face id at the snapshot plan checked), else the one validation recounted with.",
        "section": SECTION_TOKENIZE,
    },
    "tokenization": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^[a-z0-9][a-z0-9_-]{0,62}$",
        "description": "Name of this tokenization of the dataset: 'default' writes directly under tokenized/, any "
        "other name under tokenized/<name>/, beside the others (the dataset card lists them all). The same name "
        "with the same settings resumes; with other settings it is refused (the message names a free name). "
        "Null = the tokenization already made with these settings, else 'default' when free, else a new name "
        "derived from the settings (s-<hash>).",
        "section": SECTION_TOKENIZE,
    },
    "answers": {
        "type": "string",
        "enum": ["regenerated", "original"],
        "default": "regenerated",
        "description": "Which answers become training rows: 'regenerated' (the target model's own, token-exact) or "
        "'original': the input's answers (each row's original_messages) as a user who did not regenerate would train "
        "on them: at the regenerated turns' places, rendered with the chat template in the row's thinking mode "
        "(thinking on: an answer without reasoning gets the template's empty think block, trained; thinking off: "
        "its reasoning is left out), loss on the answer's tokens, encoded from its text (no engine ids: not "
        "token-exact). Quality flags describe the regenerated answers, so only near_duplicate applies. Needs its "
        "own tokenization name (never 'default'; null = 'original'). docs/tokenize.md.",
        "section": SECTION_TOKENIZE,
    },
    "train_turns": {
        "type": "string",
        "enum": ["all", "last"],
        "default": "all",
        "description": "Which regenerated assistant turns become training rows: 'all' (one row per turn, its "
        "context exactly what that turn's request carried), or only the 'last'. Only tokens the model "
        "generated carry loss; answers copied from the input are context, never trained.",
        "section": SECTION_TOKENIZE,
    },
    "loss_on_reasoning": {
        "type": "boolean",
        "default": True,
        "description": "Train the reasoning (its <think> markup included) of the trained turns, not only their "
        "answers: a drafter for a thinking model must draft the thinking.",
        "section": SECTION_TOKENIZE,
    },
    "drop_truncated": {
        "type": "boolean",
        "default": False,
        "description": "Drop rows whose generation stopped at max_tokens (finish_reason 'length'); counted "
        "in the report either way.",
        "section": SECTION_TOKENIZE,
    },
    "train_eot_newline": {
        "type": "boolean",
        "default": True,
        "description": "Append the template's text after the end-of-turn token the model emitted (ChatML's "
        "newline after <|im_end|>) and train it, as SpecForge's mask does; false leaves it out. The "
        "end-of-turn token itself is always trained; a turn cut at max_tokens has neither.",
        "section": SECTION_TOKENIZE,
    },
    "keep_unverified": {
        "type": "boolean",
        "default": False,
        "description": "Keep turns whose engine returned no token ids and whose re-encoded text does not match "
        "the engine's token counts (counted and named in the report either way). Off: they stay out "
        "of the shards.",
        "section": SECTION_TOKENIZE,
    },
    "heldout_uri": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "s3://bucket/key of a file naming conversations to keep out of the shards on top of the "
        "dataset's own held-out split (always enforced): one id per line, or prompt rows whose id is taken. For "
        "a dataset planned before it had a split, or a benchmark named later. Pinned with the settings.",
        "section": SECTION_TOKENIZE,
    },
    "min_kept_share": {
        "type": "number",
        "default": 0.7,
        "minimum": 0,
        "maximum": 1,
        "description": "Fail the run (after writing tokenized/report.json with the reasons) when the training rows "
        "kept are fewer than this share of the rows counted (kept + dropped for any reason but heldout). Catches a "
        "wrong tokenizer, a filter that flags everything, a dataset of errors. 0 turns the gate off (a run that "
        "keeps no row still fails). The simulator at the job's lengths keeps 91% with thinking on (its thinking "
        "cut at max_tokens dropped) and 100% off: docs/quality.md.",
        "section": SECTION_TOKENIZE,
    },
    "workers": {
        "type": "integer",
        "default": 4,
        "minimum": 1,
        "maximum": 256,
        "description": "Mapped tokenize tasks; the dataset's parts are split among them (each encodes on all "
        "the cores of its worker).",
        "section": SECTION_RUN,
    },
    "aws_conn_id": {
        "type": "string",
        "default": "aws_default",
        "minLength": 1,
        "description": "Airflow connection id (type aws) of the datasets' S3 store.",
        "section": SECTION_DATA,
    },
}


# -- what the trainers read (issue 23): output profiles and DFlash-ready rows. One block; the sources of the
# defaults are in steps/tokenize/dflash.py and docs/trainers.md.
TOKENIZE_PROFILES = ("parquet", "specforge", "speculators")
DEFAULT_FORMATS = ("parquet", "specforge")
"""What a user needs by default: Parquet to check exactness (and load with datasets), SpecForge's files to train
DFlash (docs/trainers.md, "Storage")."""
DFLASH_MIN_LOSS_TOKENS = 2  # SpecForge 0.2.0's DFlash rule (dflash_min_loss_tokens); why: docs/quality.md "Tokenize gates"
TRAINER_PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "max_length": {
        "type": "integer",
        "default": 4096,
        "minimum": 16,
        "maximum": 1048576,
        "description": "Tokens per training row at most (SpecForge's Qwen3.5/3.6 DFlash recipes use 4096): a longer "
        "row is cut here, as SpecForge and speculators cut it, and flagged truncated_to_max_length.",
        "section": SECTION_TOKENIZE,
    },
    "formats": {
        "type": "array",
        "default": list(DEFAULT_FORMATS),
        "minItems": 1,
        "uniqueItems": True,
        "items": {"type": "string", "enum": list(TOKENIZE_PROFILES)},
        "description": "Trainer formats written per part, one folder each under the tokenization's folder. Storage "
        "per 1 M completions rows, measured (bench/part_size_bench.py: ~2,160 generated + ~540 prompt tokens a row, "
        "1.33 training rows a row, Qwen's BPE): 'parquet' 3.44 GiB (every column: ids, mask, ids_source and "
        "ids_canonical to check exactness; datasets loads it), 'specforge' 27.7 GiB (16.4 pre-tokenized JSONL for "
        "data.prompts_path + 11.3 conversations JSONL for data.train_data_path), 'speculators' 16.7 GiB "
        "(speculators prepare-data). Default: parquet + specforge (check, and train DFlash with SpecForge); add "
        "'speculators' for vLLM speculators. The completions themselves cost 7.61 GiB (4.05 without the engine's "
        "prompt and output ids).",
        "section": SECTION_TOKENIZE,
    },
    "min_loss_tokens": {
        "type": "integer",
        "default": DFLASH_MIN_LOSS_TOKENS,
        "minimum": 0,
        "maximum": 1048576,
        "description": "Drop rows with fewer trained tokens (after the cut at max_length); counted in the report by "
        "thinking mode and domain. Default 2, SpecForge 0.2.0's own DFlash rule: a higher floor drops short answers, "
        "mostly thinking-off ones (32 dropped 90% of the demo's thinking-off turns, 23% of thinking-on: "
        "docs/quality.md).",
        "section": SECTION_TOKENIZE,
    },
    "require_consecutive_loss_tokens": {
        "type": "boolean",
        "default": True,
        "description": "Drop rows without two adjacent trained tokens: DFlash anchors each block on one, and "
        "SpecForge refuses batches without them. Only an EAGLE-only dataset can turn this off.",
        "section": SECTION_TOKENIZE,
    },
}
TOKENIZE_PARAM_SCHEMAS.update(TRAINER_PARAM_SCHEMAS)
TOKENIZE_PARAM_SCHEMAS["target_mix"] = target_mix_schema(SECTION_TOKENIZE)  # the mix report's target (report only)

ANSWERS = ("regenerated", "original")
ANSWERS_ORIGINAL = "original"
ORIGINAL_TOKENIZATION = "original"
"""The name a tokenization of the original answers takes when none is given (and free)."""
PROMPT_QUALITY_FLAGS = ("near_duplicate",)
"""The quality flags that describe the prompt, not the answer: the only ones that apply to original answers (the
others are signals of the regenerated answer: its loops, its thinking cut at max_tokens, its refusal...)."""

# The trigger form's essentials (config.run.form_layout puts them first; the rest is "Advanced: ...").
TOKENIZE_ESSENTIAL_PARAMS: tuple[str, ...] = ("output_uri", "tokenizer", "max_length", "formats", "tokenization")
# -- quality filtering and gates (issue 32; steps/tokenize/gates.py, steps/tokenize/qualityfilter.py) --------
QUALITY_FLAG_NAMES = ("loop_reasoning", "loop_answer", "truncated_thinking", "empty_answer", "refusal",
                      "near_duplicate", "language")
"""steps.quality.QUALITY_FLAGS (config cannot import steps; a unit test keeps the two equal)."""
ROW_QUALITY_PARAMS = ("loop_ngram", "loop_min_span_tokens", "loop_min_repeats", "loop_max_period", "refusal_patterns",
                      "refusal_scan_chars", "languages", "language_min_score", "language_min_chars")
"""The quality params that decide a row's signals, taken by tokenize too (same names, schemas and defaults as
dflash_generate's validation), pinned with the settings."""
GATE_PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "drop_quality": {
        "type": "array",
        "default": list(QUALITY_FLAG_NAMES),
        "uniqueItems": True,
        "items": {"type": "string", "enum": list(QUALITY_FLAG_NAMES)},
        "description": "Quality flags whose rows are dropped (each counted as 'quality:<flag>' in the report and the "
        "card, by thinking mode and domain): repetition loops in reasoning or answer, thinking cut at max_tokens, "
        "empty answers, refusals (refusal_patterns), near-duplicate prompts (found at validation), answers not in "
        "'languages' (only when that list is given). [] keeps every row. docs/quality.md explains each flag.",
        "section": SECTION_TOKENIZE,
    },
}
TOKENIZE_PARAM_SCHEMAS.update(GATE_PARAM_SCHEMAS)
TOKENIZE_PARAM_SCHEMAS.update({name: {**QUALITY_PARAM_SCHEMAS[name], "section": SECTION_TOKENIZE}
                               for name in ROW_QUALITY_PARAMS})


@dataclass(frozen=True)
class TokenizeConfig:
    """dflash_tokenize's params, checked (Airflow checks the schemas; this also serves library callers)."""

    output_uri: str | None = None
    tokenizer: str | None = None
    max_length: int = 4096
    train_turns: str = "all"
    loss_on_reasoning: bool = True
    drop_truncated: bool = False
    train_eot_newline: bool = True
    keep_unverified: bool = False
    workers: int = 4
    aws_conn_id: str = "aws_default"
    profiles: tuple[str, ...] = TOKENIZE_PROFILES
    """The `formats` param (library callers that build the config get every format unless they say)."""
    min_loss_tokens: int = DFLASH_MIN_LOSS_TOKENS
    require_consecutive_loss_tokens: bool = True
    heldout_uri: str | None = None
    min_kept_share: float = TOKENIZE_PARAM_SCHEMAS["min_kept_share"]["default"]
    drop_quality: tuple[str, ...] = QUALITY_FLAG_NAMES
    quality: tuple[tuple[str, Any], ...] = ()
    """The ROW_QUALITY_PARAMS given (name, value); missing ones take their defaults."""
    target_mix: dict[str, dict[str, float]] | None = None
    tokenization: str | None = None
    answers: str = "regenerated"
    """'regenerated' (the target model's answers) or 'original' (the input's: original_messages)."""

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "TokenizeConfig":
        params = {k: v for k, v in dict(params).items()}
        if "profiles" in params:  # the formats param's name before issue 33
            params.setdefault("formats", params.pop("profiles"))
        unknown = sorted(set(params) - set(TOKENIZE_PARAM_SCHEMAS))
        if unknown:
            raise ConfigError(f"unknown conf key(s) {unknown}; valid keys are {sorted(TOKENIZE_PARAM_SCHEMAS)}")
        for name, value in params.items():
            _check_schema(name, value, TOKENIZE_PARAM_SCHEMAS[name])
        for name in ("output_uri", "tokenizer", "heldout_uri"):
            value = params.get(name)
            if isinstance(value, str) and (name != "tokenizer" or value.startswith("s3://")):
                try:
                    parse_s3_uri(value, what=name)
                except UriError as exc:
                    raise ConfigError(str(exc)) from exc
        values = {n: params.get(n, s.get("default")) for n, s in TOKENIZE_PARAM_SCHEMAS.items()}
        values["target_mix"] = check_target_mix(params.get("target_mix"))
        values["tokenizer"] = values["tokenizer"] or None
        values["heldout_uri"] = values["heldout_uri"] or None
        values["tokenization"] = values["tokenization"] or None
        if values["tokenization"] is not None and not TOKENIZATION_NAME_RE.match(values["tokenization"]):
            raise ConfigError(f"tokenization {values['tokenization']!r}: use 1-63 lower-case letters, digits, '_' or "
                              "'-', starting with a letter or digit")
        if values["tokenization"] in TOKENIZED_RESERVED:
            raise ConfigError(f"tokenization {values['tokenization']!r} is the name of a folder of the default "
                              f"tokenization; not one of {sorted(TOKENIZED_RESERVED)}")
        _check_original_answers(params, values)
        formats = values.pop("formats")
        values["profiles"] = tuple(p for p in TOKENIZE_PROFILES if p in formats)
        values["drop_quality"] = tuple(f for f in QUALITY_FLAG_NAMES if f in values["drop_quality"])
        quality = {n: values.pop(n) for n in ROW_QUALITY_PARAMS}
        values["quality"] = tuple((n, tuple(v) if isinstance(v, list) else v) for n, v in quality.items())
        from dflash_pipeline.config.quality import compile_patterns

        compile_patterns(quality["refusal_patterns"])  # a bad pattern is refused here, before any worker
        return cls(**values)

    def quality_params(self) -> dict[str, Any]:
        """The row-signal quality params, every one (defaults filled in), JSON-ready."""
        given = dict(self.quality)
        return {n: (list(v) if isinstance(v, tuple) else v) for n, v in
                ((n, given.get(n, QUALITY_PARAM_SCHEMAS[n]["default"])) for n in ROW_QUALITY_PARAMS)}


def _check_original_answers(given: dict[str, Any], values: dict[str, Any]) -> None:
    """answers 'original': another tokenization than 'default' (the regenerated one the asset-triggered run
    writes), and no quality flag of the regenerated answers asked for (they say nothing of the original ones);
    drop_quality not given = the prompt's flags only."""
    if values["answers"] != ANSWERS_ORIGINAL:
        return
    if values["tokenization"] == DEFAULT_TOKENIZATION:
        raise ConfigError(f"answers 'original' cannot be the {DEFAULT_TOKENIZATION!r} tokenization (it holds the "
                          f"regenerated answers): give another name, e.g. tokenization={ORIGINAL_TOKENIZATION!r}")
    if "drop_quality" not in given:
        values["drop_quality"] = [f for f in values["drop_quality"] if f in PROMPT_QUALITY_FLAGS]
        return
    answer_flags = [f for f in values["drop_quality"] if f not in PROMPT_QUALITY_FLAGS]
    if answer_flags:
        raise ConfigError(f"drop_quality {answer_flags} with answers 'original': those flags are signals of the "
                          f"regenerated answers, not of the original ones; only {list(PROMPT_QUALITY_FLAGS)} (the "
                          "prompt's) applies. Leave drop_quality out or give a subset of that")
