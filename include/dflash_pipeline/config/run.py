"""The run's configuration: the DAG params' JSON schemas and the typed config built from them.

The schemas live here (not in the DAG file) so the UI form, the CLI and the unit tests all read the
same bounds and descriptions. Airflow validates the schemas when a run is triggered; `RunConfig`
adds the checks JSON schema cannot express (URIs, unknown keys) and is what the tasks use.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_pipeline.config.mix import target_mix_schema
from dflash_pipeline.config.schema import ConfigError, check_schema as _check_schema
from dflash_pipeline.config.quality import QUALITY_PARAM_SCHEMAS, QualitySettings
from dflash_pipeline.dataset.sampling import SAMPLING_KEYS, SamplingError, check_overrides
from dflash_pipeline.dataset.layout import UriError, parse_s3_uri
from dflash_pipeline.dataset.sources import SourceError, is_glob, parse_sources

SECTION_DATA = "Data"
SECTION_SERVERS = "Servers"
SECTION_SAMPLING = "Sampling"
SECTION_RUN = "Run control"
SECTION_VALIDATION = "Validation"

# name -> JSON schema (with Airflow's extra keys "description" and "section").
PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "prompts_uri": {
        "type": ["string", "array"],
        "oneOf": [
            {"type": "string", "pattern": "^s3://[^/]+/.+"},
            {
                "type": "array",
                "minItems": 1,
                "maxItems": 1000,
                "items": {
                    "oneOf": [
                        {"type": "string", "pattern": "^s3://[^/]+/.+"},
                        {
                            "type": "object",
                            "required": ["uri"],
                            "additionalProperties": False,
                            "properties": {
                                "uri": {"type": "string", "pattern": "^s3://[^/]+/.+"},
                                "weight": {"type": "number", "exclusiveMinimum": 0, "maximum": 64},
                                "source": {"type": "string", "minLength": 1, "maxLength": 256},
                            },
                        },
                    ]
                },
            },
        ],
        "description": "The prompt set (JSONL, .jsonl.gz or Parquet): s3://bucket/key, a prefix "
        "(s3://bucket/dir/: every prompt file under it), a glob (s3://bucket/dir/*.jsonl.gz), or a list of "
        "those, each optionally {\"uri\": ..., \"weight\": 0.5, \"source\": \"math\"}. A row has `messages` "
        "(OpenAI chat, developer/tool roles, text parts), `conversations` (ShareGPT) or `prompt`, and optionally "
        "`id`; other keys are kept as row metadata. Weight w plans each conversation floor(w) times plus once "
        "more for a deterministic (w - floor(w)) share of ids; `source` labels rows that have none. Every file's "
        "ETag is pinned. See docs/inputs.md.",
        "section": SECTION_DATA,
    },
    "output_uri": {
        "type": "string",
        "pattern": "^s3://[^/]+/.+",
        "description": "s3://bucket/prefix, the dataset root. It is the resume key: a rerun into the "
        "same root continues where the last run stopped and never regenerates saved rows.",
        "section": SECTION_DATA,
    },
    "limit": {
        "type": ["null", "integer"],
        "default": None,
        "minimum": 1,
        "description": "Only the first N prompts (after dropping rejects and duplicates). Null = all. "
        "Pinned in the manifest: a dataset root keeps the limit it was planned with.",
        "section": SECTION_DATA,
    },
    "max_rejects": {
        "type": "integer",
        "default": 0,
        "minimum": 0,
        "description": "How many bad prompt rows plan may drop (written to rejects/ with the reason) "
        "before it fails, whatever max_reject_share allows. Plan fails when the rejects exceed both.",
        "section": SECTION_DATA,
    },
    "max_reject_share": {
        "type": "number",
        "default": 0.01,
        "minimum": 0,
        "maximum": 1,
        "description": "Share of the rows read that plan may drop as bad rows (each written to rejects/ with "
        "its reason; the plan counts them by reason). Plan fails when the rejects exceed both this share and "
        "max_rejects. Set both to 0 to fail on any bad row before a request is sent.",
        "section": SECTION_DATA,
    },
    "accept_pin_changes": {
        "type": "boolean",
        "default": False,
        "description": "Continue a dataset root whose pinned model or sampling differ from this run's. "
        "Rows already saved keep their settings; the manifest records the change. The input file and "
        "limit can never change under a root.",
        "section": SECTION_DATA,
    },
    "heldout_fraction": {
        "type": "number",
        "default": 0.0,
        "minimum": 0,
        "maximum": 0.5,
        "description": "Share of the prompts held out of the training data, by conversation: an id is held "
        "out when sha256(heldout_salt:id) as a fraction of 2^64 is below this, so every sample of a prompt "
        "goes the same way and reruns agree. Held-out prompts are not generated; plan writes them to "
        "<output_uri>/heldout/prompts.jsonl.gz (a prompts_uri for the eval) and tokenize refuses them. "
        "Pinned in the manifest. 0 = no split.",
        "section": SECTION_DATA,
    },
    "heldout_salt": {
        "type": "string",
        "default": "dflash-heldout",
        "minLength": 1,
        "maxLength": 200,
        "description": "Salt of the held-out hash: another salt draws an independent split of the same "
        "ids. Pinned in the manifest with heldout_fraction.",
        "section": SECTION_DATA,
    },
    "heldout_uri": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "s3://bucket/key of a file naming prompts to hold out as well: one id per line "
        "(text or JSON), or prompt rows (JSONL, .jsonl.gz, Parquet) whose id is taken, or derived from the "
        "content as plan derives it. Null = none. Pinned in the manifest (with its ETag).",
        "section": SECTION_DATA,
    },
    "aws_conn_id": {
        "type": "string",
        "default": "aws_default",
        "minLength": 1,
        "description": "Airflow connection id (type aws) for the S3 store of prompts and outputs.",
        "section": SECTION_DATA,
    },
    "servers": {
        "type": "array",
        "minItems": 1,
        "maxItems": 1024,
        "uniqueItems": True,
        "items": {"type": "string", "minLength": 1},
        "description": "SGLang servers, one per GPU: a base URL (http://host:30000) or an Airflow "
        "connection id (host, port; the API key in the password field). One mapped generate task "
        "drives each server.",
        "section": SECTION_SERVERS,
    },
    "model": {
        "type": ["null", "string"],
        "default": None,
        "description": "The served model every server must report (served_model_name or model_path). "
        "Null = take it from the servers, which must then all agree.",
        "section": SECTION_SERVERS,
    },
    "concurrency_per_server": {
        "type": ["null", "integer"],
        "default": None,
        "minimum": 1,
        "maximum": 4096,
        "description": "Requests in flight per server, used as given. Null = discovered from each "
        "server's live load (vLLM /metrics, SGLang /v1/loads, or the latency of a generic server's "
        "answers), starting from SGLang's max_running_requests (16 for vLLM and generic servers), "
        "plus a small queue, so slots never wait for the client and requests do not queue long "
        "enough to eat into request_timeout_s.",
        "section": SECTION_SERVERS,
    },
    "max_concurrency_per_server": {
        "type": "integer",
        "default": 1024,
        "minimum": 1,
        "maximum": 4096,
        "description": "Hard cap on the discovered in-flight limit per server (queue included); "
        "concurrency_per_server, when set, is not capped. 1024 is vLLM's largest default "
        "max_num_seqs (GPUs of 70 GiB and more).",
        "section": SECTION_SERVERS,
    },
    "require_token_exact": {
        "type": "boolean",
        "default": False,
        "description": "Refuse the run at preflight, before any generation, when a server's proof answer "
        "carries no engine token ids (SGLang < 0.5.17, vLLM < 0.10.2, generic servers): its rows would be "
        "re-encoded from text at tokenize (checked against the prompt's ids where given, but not the tokens "
        "the model produced). False = run, with a warning naming those servers in the log, the manifest "
        "and the progress page.",
        "section": SECTION_SERVERS,
    },
    "request_timeout_s": {
        "type": "number",
        "default": 300,
        "exclusiveMinimum": 0,
        "maximum": 86400,
        "description": "Floor of a generation request's deadline, and how soon a request the server "
        "is not generating (server stuck, gone, or holding none of ours) is cut. A request the server "
        "is generating may take max_tokens at its slowest measured decode speed (docs/engines.md). "
        "A timed-out request is retried once.",
        "section": SECTION_SERVERS,
    },
    "max_tokens": {
        "type": "integer",
        "default": 4096,
        "minimum": 1,
        "maximum": 1048576,
        "description": "Output token budget per completion, thinking included. Thinking models need "
        "thousands: with 512 the thinking eats everything and no answer is produced.",
        "section": SECTION_SAMPLING,
    },
    "temperature": {
        "type": "number",
        "default": 0.6,
        "minimum": 0,
        "maximum": 2,
        "description": "Sampling temperature (Qwen3 thinking mode recommends 0.6).",
        "section": SECTION_SAMPLING,
    },
    "top_p": {
        "type": "number",
        "default": 0.95,
        "exclusiveMinimum": 0,
        "maximum": 1,
        "description": "Nucleus sampling (Qwen3 thinking mode recommends 0.95).",
        "section": SECTION_SAMPLING,
    },
    "enable_thinking": {
        "type": "boolean",
        "default": True,
        "description": "Sent as chat_template_kwargs.enable_thinking.",
        "section": SECTION_SAMPLING,
    },
    "thinking_fraction": {
        "type": ["null", "number"],
        "default": None,
        "minimum": 0,
        "maximum": 1,
        "description": "Share of the conversations generated with thinking on (the rest off): a mixed "
        "dataset in one run. Rows that give their own `enable_thinking` keep it; the others are assigned "
        "in plan order, exactly this share per block of 64 conversations (which ones by a hash of the id), "
        "so the mix is within one conversation per block of the fraction and the same on every rerun. "
        "Every sample of a conversation has its mode. Null = enable_thinking for all rows. Pinned in the "
        "manifest with the input (docs/mix.md).",
        "section": SECTION_SAMPLING,
    },
    "row_settings": {
        "type": "string",
        "enum": ["apply", "record"],
        "default": "apply",
        "description": "What a prompt row's own `enable_thinking` and `sampling` do. 'apply': they override "
        "the run's settings for that row (a mixed dataset). 'record': every request is sent with the run's "
        "settings; the rows' own are kept in each row's metadata (`row_enable_thinking`, `row_sampling`) "
        "and counted in the manifest (input.row_settings). dflash_eval uses 'record', so a condition sends "
        "what it names. Pinned with the input.",
        "section": SECTION_SAMPLING,
    },
    "sampling_extra": {
        "type": ["null", "object"],
        "default": None,
        "propertyNames": {"enum": list(SAMPLING_KEYS)},  # a misspelt key is refused at trigger
        "description": "More sampling fields sent with every request, e.g. {\"top_k\": 20, \"min_p\": 0, "
        "\"presence_penalty\": 1.5, \"stop\": [\"</answer>\"]}. Accepted keys: top_k, min_p, presence_penalty, "
        "frequency_penalty, repetition_penalty, stop, stop_token_ids, min_tokens, ignore_eos, "
        "skip_special_tokens, logit_bias, and the engine-only stop_regex, no_stop_trim (SGLang), "
        "include_stop_str_in_output, spaces_between_special_tokens, bad_words, allowed_token_ids (vLLM); "
        "unknown keys and wrong types are refused, and preflight refuses a key a server's engine does "
        "not accept. A row's own `sampling` object overrides these per row. Null = none.",
        "section": SECTION_SAMPLING,
    },
    "sampling_ladder": {
        "type": ["null", "array"],
        "default": None,
        "minItems": 1,
        "maxItems": 64,
        "items": {"type": "object", "propertyNames": {"enum": list(SAMPLING_KEYS)}},
        "description": "Per-sample overrides: sample k is sent with entry k mod len over the run's "
        "settings (a row's `sampling` still wins), e.g. [{\"temperature\": 0.6}, {\"temperature\": 1.0}] "
        "with samples_per_prompt 2 for a temperature ladder. Same keys as sampling_extra. Null = none.",
        "section": SECTION_SAMPLING,
    },
    "seed": {
        "type": ["null", "integer"],
        "default": None,
        "minimum": 0,
        "description": "If set, each request carries a seed derived from this and the prompt id, so a "
        "regenerated row samples the same way. Null = no seed.",
        "section": SECTION_SAMPLING,
    },
    "regenerate": {
        "type": "string",
        "enum": ["last_turn", "all_turns"],
        "default": "last_turn",
        "description": "'last_turn': the conversation as given, one new answer to its last user turn. "
        "'all_turns': system and user turns kept verbatim, every assistant turn regenerated in order, each "
        "request carrying the regenerated answers before it (not their reasoning); a turn that ends with "
        "'length' or fails for good ends the conversation there (the row's cut_short says why). Rows with "
        "roles it cannot replay (tool) are rejected in plan. Pinned in the manifest.",
        "section": SECTION_SAMPLING,
    },
    "samples_per_prompt": {
        "type": "integer",
        "default": 1,
        "minimum": 1,
        "maximum": 64,
        "description": "Independent samples per prompt, each with its own seed (derived from seed, the id "
        "and the sample index): exactly one row per (id, sample). Part of the plan: a dataset root keeps "
        "the value it was planned with.",
        "section": SECTION_SAMPLING,
    },
    "save_every": {
        "type": "integer",
        "default": 500,
        "minimum": 1,
        "maximum": 100000,
        "description": "Completions per part written to S3. A killed task loses at most the parts it "
        "had not yet written.",
        "section": SECTION_RUN,
    },
    "max_attempts": {
        "type": "integer",
        "default": 5,
        "minimum": 1,
        "maximum": 50,
        "description": "Tries per request for transient failures (connection errors, timeouts, 5xx, "
        "503), with exponential backoff and jitter. Context-length errors are never retried.",
        "section": SECTION_RUN,
    },
    "retry_failed_rows": {
        "type": "string",
        "enum": ["transient", "all", "none"],
        "default": "transient",
        "description": "Which error rows saved by an earlier run into this output_uri are tried again: "
        "'transient' (timeouts, connection errors, 5xx), 'all' (also context-length and other "
        "permanent errors) or 'none'.",
        "section": SECTION_RUN,
    },
    "server_lost_after_s": {
        "type": "number",
        "default": 120,
        "minimum": 1,
        "maximum": 86400,
        "description": "A server that answers nothing for this long is declared lost: its unfinished "
        "work is released to the other servers and its task fails (Airflow retries it later).",
        "section": SECTION_RUN,
    },
    "server_handoff_after_s": {
        "type": "number",
        "default": 5,
        "minimum": 1,
        "maximum": 3600,
        "description": "A server that has failed every request for this long (dead, or answering "
        "/health while every generation fails) hands its unfinished chunks (finished rows saved) to "
        "the other servers at once, stops claiming and goes on probing it with a 1-token generation; "
        "it takes new work again when one succeeds, or fails after server_lost_after_s.",
        "section": SECTION_RUN,
    },
    "claim_lease_s": {
        "type": "number",
        "default": 180,
        "minimum": 5,
        "maximum": 86400,
        "description": "How long a chunk claimed by a task that stopped renewing it stays locked "
        "before another server's task may take it over.",
        "section": SECTION_RUN,
    },
    "min_coverage": {
        "type": "number",
        "default": 1.0,
        "minimum": 0,
        "maximum": 1,
        "description": "validate_and_count fails when fewer than this share of the planned prompts have a "
        "row (a completion or an error row). 1.0 = every prompt: a rerun into the same output_uri only does "
        "the missing work, so completing is cheap and a hole is never silent.",
        "section": SECTION_VALIDATION,
    },
    "max_error_rate": {
        "type": "number",
        "default": 0.01,
        "minimum": 0,
        "maximum": 1,
        "description": "validate_and_count fails when more than this share of the rows are error rows "
        "(requests that failed for good: context length, or transient errors left after max_attempts). "
        "1% allows the few prompts longer than the context; more means a sick server or a wrong setting.",
        "section": SECTION_VALIDATION,
    },
    "max_truncation_rate": {
        "type": "number",
        "default": 0.10,
        "minimum": 0,
        "maximum": 1,
        "description": "validate_and_count fails when more than this share of the completions stopped at "
        "max_tokens (finish_reason 'length'). Thinking models run long: above 10% the budget is too small "
        "for the prompt set and the data over-represents cut-off reasoning.",
        "section": SECTION_VALIDATION,
    },
    "max_missing_reasoning_rate": {
        "type": "number",
        "default": 0.005,
        "minimum": 0,
        "maximum": 1,
        "description": "With enable_thinking, validate_and_count fails when more than this share of the "
        "completions have no reasoning (a server without a reasoning parser whose answers could not be "
        "split, an engine that names the field differently): the failure names the servers they came from.",
        "section": SECTION_VALIDATION,
    },
    "max_loop_rate": {
        "type": ["null", "number"],
        "default": None,
        "minimum": 0,
        "maximum": 1,
        "description": "validate_and_count fails when more than this share of the completions hold a repetition "
        "loop (quality signals loop_reasoning / loop_answer), and with fail_fast a run is stopped early when its "
        "live loop rate is surely above it. Null = no limit (loops are counted and dropped at tokenize).",
        "section": SECTION_VALIDATION,
    },
    "fail_fast": {
        "type": "boolean",
        "default": True,
        "description": "While generating, check the run's live figures (truncation, missing reasoning, and loops "
        "with max_loop_rate) against these limits with a confidence bound, and stop the run with a message naming "
        "the figure and the servers once one is surely above its limit (docs/quality.md, 'Fail fast'). False: "
        "generate everything and let validation judge.",
        "section": SECTION_VALIDATION,
    },
    "validation_workers": {
        "type": "integer",
        "default": 1,
        "minimum": 1,
        "maximum": 64,
        "description": "Mapped tasks (each on its own Airflow worker) that compute the part digests validation "
        "still lacks (parts from an older version, a crash between a part and its digest) before the merge.",
        "section": SECTION_VALIDATION,
    },
    "tokenizer": {
        "type": ["null", "string"],
        "default": None,
        "description": "The training tokenizer: a Hugging Face id (Qwen/Qwen3-8B, or Qwen/Qwen3-8B@<revision>; "
        "through the hub cache HF_HOME/HF_HUB_CACHE, cache only when HF_HUB_OFFLINE=1), a local tokenizer.json or "
        "model directory, s3://bucket/path/tokenizer.json, or an s3:// prefix holding tokenizer.json + "
        "tokenizer_config.json (the chat template). Checked at plan, before any request: loaded, its template "
        "rendered with thinking on and off; recorded in the manifest (revision or ETag, sha256s). Validation "
        "recounts tokens with it and the asset-triggered dflash_tokenize run uses it. Null = no recount.",
        "section": SECTION_VALIDATION,
    },
    "target_mix": target_mix_schema(SECTION_VALIDATION),
}

PARAM_SCHEMAS.update(QUALITY_PARAM_SCHEMAS)  # validation counts the quality signals (config/quality.py)

REQUIRED_PARAMS = ("prompts_uri", "output_uri", "servers")

# -- the trigger form: essentials first, everything else under "Advanced: <section>" --------------------
# Airflow 3.3's trigger form (airflow/ui, FlexibleForm) draws one accordion item per `section`, in the
# order each section first appears in the DAG's params (serialized as an ordered list), and opens only
# its default section, "Run Parameters" (where params without a section go), when the form loads; every
# other section starts collapsed. So the essentials take that section and come first: a user sees them
# on opening the form and the tuning and protocol internals stay folded away with their safe defaults.
ESSENTIALS_SECTION = "Run Parameters"
ADVANCED_PREFIX = "Advanced: "
ADVANCED_SECTION = "Advanced"  # a non-essential param without a section of its own

# What a user sets for a run (the rest has safe defaults); in the order the form shows them.
ESSENTIAL_PARAMS: tuple[str, ...] = (
    "prompts_uri", "output_uri", "servers", "model", "tokenizer",
    "max_tokens", "temperature", "top_p", "enable_thinking", "thinking_fraction", "samples_per_prompt",
    "regenerate", "limit",
)


def form_layout(schemas: dict[str, dict[str, Any]], essentials: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """The schemas reordered and re-sectioned for the trigger form (the schemas given are not changed).

    The essentials present come first, in `essentials` order, in ESSENTIALS_SECTION; every other param
    keeps its order and goes to "Advanced: <its section>" ("Advanced" without one), so params added with
    any SECTION_* constant land in the advanced part without being listed here. Names in `essentials`
    that the schemas lack are skipped (tests/unit/test_params_form.py keeps the lists true)."""
    out: dict[str, dict[str, Any]] = {}
    for name in essentials:
        if name in schemas:
            out[name] = {**schemas[name], "section": ESSENTIALS_SECTION}
    for name, schema in schemas.items():
        if name in out:
            continue
        section = schema.get("section")
        if section in (ESSENTIALS_SECTION, ADVANCED_SECTION) or (section or "").startswith(ADVANCED_PREFIX):
            out[name] = dict(schema)  # already laid out
        else:
            out[name] = {**schema, "section": f"{ADVANCED_PREFIX}{section}" if section else ADVANCED_SECTION}
    return out


@dataclass(frozen=True)
class Sampling:
    """What makes two completions comparable; pinned in the manifest."""

    max_tokens: int = 4096
    temperature: float = 0.6
    top_p: float = 0.95
    enable_thinking: bool = True
    seed: int | None = None
    regenerate: str = "last_turn"
    samples_per_prompt: int = 1
    # Mixes (dataset/sampling.py): the share of conversations that think (None: enable_thinking for
    # all), extra sampling fields for every request, and per-sample overrides (sample k: entry k % len).
    thinking_fraction: float | None = None
    extra: dict[str, Any] = field(default_factory=dict, hash=False)
    # "apply": a row's own enable_thinking / sampling override the run's; "record": kept, not sent.
    row_settings: str = "apply"
    ladder: tuple[dict[str, Any], ...] = field(default=(), hash=False)

    def base_fields(self) -> dict[str, Any]:
        """The run's sampling fields of a request before per-sample and per-row overrides."""
        return {"max_tokens": self.max_tokens, "temperature": self.temperature, "top_p": self.top_p, **self.extra}

    def largest_max_tokens(self) -> int:
        """The largest max_tokens a request of the run may carry (its ladder may raise it per sample)."""
        return max(int(e.get("max_tokens", self.extra.get("max_tokens", self.max_tokens)))
                   for e in (self.ladder or ({},)))

    def override_keys(self) -> set[str]:
        """Every sampling key the run's extras and ladder send (for preflight's per-engine check)."""
        return set(self.extra).union(*(set(e) for e in self.ladder))


@dataclass(frozen=True)
class RunConfig:
    # A string, or a list of strings / {"uri", "weight", "source"} (dataset/sources.py resolves it).
    prompts_uri: Any
    output_uri: str
    servers: tuple[str, ...]
    model: str | None = None
    sampling: Sampling = field(default_factory=Sampling)
    concurrency_per_server: int | None = None
    max_concurrency_per_server: int = 1024
    save_every: int = 500
    request_timeout_s: float = 300.0
    limit: int | None = None
    max_rejects: int = 0
    max_reject_share: float = 0.01
    accept_pin_changes: bool = False
    require_token_exact: bool = False
    aws_conn_id: str = "aws_default"
    max_attempts: int = 5
    retry_failed_rows: str = "transient"
    server_lost_after_s: float = 120.0
    server_handoff_after_s: float = 5.0
    claim_lease_s: float = 180.0
    min_coverage: float = 1.0
    max_error_rate: float = 0.01
    max_truncation_rate: float = 0.10
    max_missing_reasoning_rate: float = 0.005
    max_loop_rate: float | None = None
    fail_fast: bool = True
    validation_workers: int = 1
    tokenizer: str | None = None
    heldout_fraction: float = 0.0
    heldout_salt: str = "dflash-heldout"
    heldout_uri: str | None = None
    target_mix: dict[str, dict[str, float]] | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "RunConfig":
        """Build from the DAG params (already schema-checked by Airflow) and check what it can't."""
        params = dict(params)
        unknown = sorted(set(params) - set(PARAM_SCHEMAS))
        if unknown:
            raise ConfigError(
                f"unknown conf key(s) {unknown}; valid keys are {sorted(PARAM_SCHEMAS)}"
            )
        missing = [k for k in REQUIRED_PARAMS if params.get(k) in (None, "", [])]
        if missing:
            raise ConfigError(f"required param(s) missing: {missing}")
        for name, value in params.items():
            _check_schema(name, value, PARAM_SCHEMAS[name])
        QualitySettings.from_params(params)  # a refusal pattern that is not a regex is refused here
        try:
            specs = parse_sources(params["prompts_uri"])
            out = parse_s3_uri(params["output_uri"], what="output_uri")
        except (UriError, SourceError) as exc:
            raise ConfigError(str(exc)) from exc
        for spec in specs:
            bucket, _, key = spec.uri[len("s3://"):].partition("/")
            key = key.strip("/")
            # A prefix (or a `**` glob) above the root would list the root's own files as prompts.
            base = key[: min(key.find(c) for c in "*?[" if c in key)].rsplit("/", 1)[0] if is_glob(key) else key
            holds = (not is_glob(key) or "**" in key) and (not base or out.key.startswith(base + "/"))
            if bucket == out.bucket and (key == out.key or key.startswith(out.key + "/") or holds):
                raise ConfigError(f"prompts_uri {spec.uri} must not lie inside output_uri (the dataset root) or be a prefix holding it")
        heldout_uri = params.get("heldout_uri")
        if heldout_uri is not None:
            try:
                parse_s3_uri(heldout_uri, what="heldout_uri")
            except UriError as exc:
                raise ConfigError(str(exc)) from exc
        tokenizer = params.get("tokenizer")
        if isinstance(tokenizer, str) and tokenizer.startswith("s3://"):
            try:
                parse_s3_uri(tokenizer, what="tokenizer")
            except UriError as exc:
                raise ConfigError(str(exc)) from exc

        from dflash_pipeline.config.mix import check_target_mix

        target_mix = check_target_mix(params.get("target_mix"))

        def get(name: str) -> Any:
            return params.get(name, PARAM_SCHEMAS[name].get("default"))

        try:
            extra = check_overrides(get("sampling_extra") or {}, "param sampling_extra")
            ladder = tuple(check_overrides(e, f"param sampling_ladder[{i}]")
                           for i, e in enumerate(get("sampling_ladder") or []))
        except SamplingError as exc:
            raise ConfigError(str(exc)) from exc
        for i, entry in enumerate(ladder or ({},)):
            merged = {"max_tokens": get("max_tokens"), **extra, **entry}
            if int(merged.get("min_tokens") or 0) > int(merged["max_tokens"]):
                where = f"sampling_ladder[{i}]" if ladder else "sampling_extra"
                raise ConfigError(f"{where}: min_tokens {merged['min_tokens']} is more than max_tokens "
                                  f"{merged['max_tokens']}: the engines refuse every such request")
        fraction = get("thinking_fraction")

        sampling = Sampling(
            max_tokens=int(get("max_tokens")),
            temperature=float(get("temperature")),
            top_p=float(get("top_p")),
            enable_thinking=bool(get("enable_thinking")),
            seed=None if get("seed") is None else int(get("seed")),
            regenerate=str(get("regenerate")),
            samples_per_prompt=int(get("samples_per_prompt")),
            thinking_fraction=None if fraction is None else float(fraction),
            extra=extra,
            ladder=ladder,
            row_settings=str(get("row_settings")),
        )
        return cls(
            prompts_uri=params["prompts_uri"] if isinstance(params["prompts_uri"], str) else list(params["prompts_uri"]),
            output_uri=f"s3://{out.bucket}/{out.key}",
            servers=tuple(params["servers"]),
            model=get("model"),
            sampling=sampling,
            concurrency_per_server=get("concurrency_per_server"),
            max_concurrency_per_server=int(get("max_concurrency_per_server")),
            save_every=int(get("save_every")),
            request_timeout_s=float(get("request_timeout_s")),
            limit=get("limit"),
            max_rejects=int(get("max_rejects")),
            max_reject_share=float(get("max_reject_share")),
            accept_pin_changes=bool(get("accept_pin_changes")),
            require_token_exact=bool(get("require_token_exact")),
            aws_conn_id=get("aws_conn_id"),
            max_attempts=int(get("max_attempts")),
            retry_failed_rows=str(get("retry_failed_rows")),
            server_lost_after_s=float(get("server_lost_after_s")),
            server_handoff_after_s=float(get("server_handoff_after_s")),
            claim_lease_s=float(get("claim_lease_s")),
            min_coverage=float(get("min_coverage")),
            max_error_rate=float(get("max_error_rate")),
            max_truncation_rate=float(get("max_truncation_rate")),
            max_missing_reasoning_rate=float(get("max_missing_reasoning_rate")),
            max_loop_rate=None if get("max_loop_rate") is None else float(get("max_loop_rate")),
            fail_fast=bool(get("fail_fast")),
            validation_workers=int(get("validation_workers")),
            tokenizer=get("tokenizer") or None,
            heldout_fraction=float(get("heldout_fraction")),
            heldout_salt=str(get("heldout_salt")),
            heldout_uri=get("heldout_uri") or None,
            target_mix=target_mix,
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["servers"] = list(self.servers)
        return data


def short_server_labels(names: list[str], max_len: int = 22) -> list[str]:
    """Short, still distinct labels for server names (URLs or connection ids), for plot axes.

    Full URLs side by side overlap on an axis; what tells servers apart is the host:port. The
    scheme, path and the hosts' DNS domain go (`http://gpu3.cluster.internal:30000` is
    `gpu3:30000`) as long as the labels stay distinct, else the whole host:port is kept; a label
    still longer than `max_len` keeps its end behind an ellipsis, unless that makes two equal.
    """
    from urllib.parse import urlsplit

    def host_port(name: str, domain: bool) -> str:
        if "://" not in name:
            return name  # a connection id
        parts = urlsplit(name)
        host = parts.hostname or name
        if not domain and not host.replace(".", "").isdigit() and ":" not in host:
            host = host.split(".", 1)[0]
        if ":" in host:
            host = f"[{host}]"  # IPv6
        return f"{host}:{parts.port}" if parts.port else host

    distinct = len(set(names))
    labels = [host_port(n, domain=False) for n in names]
    if len(set(labels)) < distinct:
        labels = [host_port(n, domain=True) for n in names]
    if len(set(labels)) < distinct:
        labels = [n.split("://", 1)[-1].rstrip("/") or n for n in names]
    short = [b if len(b) <= max_len else "\u2026" + b[-(max_len - 1):] for b in labels]
    return short if len(set(short)) == len(set(labels)) else labels
