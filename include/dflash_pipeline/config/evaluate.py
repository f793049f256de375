"""dflash_eval's params: drafter groups, the conditions they are measured under, and the generate
RunConfig each (group, condition) is run with.

Why here: the UI form, the CLI and the tests read one set of schemas, and every check that JSON
schema cannot express (one prompt source, drafter names usable as S3 path segments, a server in
one group only) runs in `EvalConfig.from_params` before any request is sent. A condition's data
is a plain generate dataset, so `run_config` derives the generate step's `RunConfig` rather than
copying its logic.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from dflash_pipeline.config.run import PARAM_SCHEMAS, ConfigError, RunConfig, _check_schema
from dflash_pipeline.dataset.layout import UriError, parse_s3_uri

SECTION_EVAL_DATA = "Prompts and output"
SECTION_EVAL_SERVERS = "Drafters"
SECTION_EVAL_CONDITIONS = "Conditions"
SECTION_EVAL_RUN = "Run control"

NAME_PATTERN = "^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_NAME_RE = re.compile(NAME_PATTERN)
PRODUCTION = "production"
BASELINE_ROLE = "baseline"

_GROUP_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["name", "servers"],
    "additionalProperties": False,
    "properties": {
        "name": {"type": "string", "pattern": NAME_PATTERN,
                 "description": "Drafter name: letters, digits, '.', '_', '-' (an S3 path segment)."},
        "servers": {"type": "array", "minItems": 1, "maxItems": 256, "uniqueItems": True,
                    "items": {"type": "string", "minLength": 1}},
        "card_uri": {"type": ["null", "string"], "pattern": "^s3://[^/]+/.+",
                     "description": "The drafter's card (dflash_train's <drafters root>/<name>/card.json, or the "
                     "drafter's folder): the report shows its lineage (dataset, tokenization, trainer, steps)."},
    },
}

EVAL_PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "dataset_uri": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "A dflash_generate dataset root: its held-out prompts (manifest.heldout.key) are the "
        "eval prompts. Give this or prompts_uri, not both.",
        "section": SECTION_EVAL_DATA,
    },
    "prompts_uri": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "A benchmark prompt file (same formats as dflash_generate's prompts_uri). Give this or "
        "dataset_uri, not both.",
        "section": SECTION_EVAL_DATA,
    },
    "output_uri": {
        "type": "string",
        "pattern": "^s3://[^/]+/.+",
        "description": "s3://bucket/prefix, the eval root: <drafter>/<condition>/ is one generate dataset each, "
        "report.json/.md/.png at the root. It is the resume key: a rerun only does what is missing.",
        "section": SECTION_EVAL_DATA,
    },
    "max_prompts": {
        "type": ["null", "integer"],
        "default": None,
        "minimum": 1,
        "description": "Only the first N prompts of the file (after rejects and duplicates are dropped): the "
        "same subset for every drafter and condition. Null = all.",
        "section": SECTION_EVAL_DATA,
    },
    "aws_conn_id": {
        "type": "string",
        "default": "aws_default",
        "minLength": 1,
        "description": "Airflow connection id (type aws) for the S3 store.",
        "section": SECTION_EVAL_DATA,
    },
    "drafters": {
        "type": "array",
        "minItems": 1,
        "maxItems": 32,
        "items": _GROUP_SCHEMA,
        "description": 'Drafters to measure: [{"name": "dflash-v2", "servers": ["http://gpu0:30000", "sglang_gpu1"]}, '
        "...]. Each is a group of servers (base URLs or Airflow connection ids) serving the same target with "
        "one speculative configuration. A server belongs to one group. A drafter trained by dflash_train can name "
        'its card ("card_uri": "s3://bucket/drafters/<name>/card.json"): it is read before any request, and the '
        "report carries its lineage beside its figures.",
        "section": SECTION_EVAL_SERVERS,
    },
    "baseline": {
        "type": ["null", "object"],
        "default": None,
        "required": ["name", "servers"],
        "additionalProperties": False,
        "properties": _GROUP_SCHEMA["properties"],
        "description": 'Optional group serving the target without speculation ({"name": "no-spec", "servers": '
        "[...]}): output tokens/s of each drafter is compared with it under the same condition.",
        "section": SECTION_EVAL_SERVERS,
    },
    "model": {
        "type": ["null", "string"],
        "default": None,
        "description": "The served model every server must report. Null = whatever they all serve.",
        "section": SECTION_EVAL_SERVERS,
    },
    "max_tokens": {
        "type": "integer",
        "default": 2048,
        "minimum": 1,
        "maximum": 1048576,
        "description": "Output token budget per completion (DFlash's benchmark uses 2048).",
        "section": SECTION_EVAL_CONDITIONS,
    },
    "temperature": {
        "type": "number",
        "default": 0.6,
        "minimum": 0,
        "maximum": 2,
        "description": "Production sampling temperature (the 'sampled' conditions).",
        "section": SECTION_EVAL_CONDITIONS,
    },
    "top_p": {
        "type": "number",
        "default": 0.95,
        "exclusiveMinimum": 0,
        "maximum": 1,
        "description": "Production nucleus sampling (the 'sampled' conditions).",
        "section": SECTION_EVAL_CONDITIONS,
    },
    "greedy": {
        "type": "boolean",
        "default": True,
        "description": "Also measure at temperature 0 (the 'greedy' conditions; how DFlash and SpecForge report).",
        "section": SECTION_EVAL_CONDITIONS,
    },
    "thinking_modes": {
        "type": ["null", "array"],
        "default": None,
        "minItems": 1,
        "uniqueItems": True,
        "items": {"type": "string", "enum": ["on", "off"]},
        "description": 'Thinking modes to measure: ["on", "off"] where the data has both. Null = the mode the '
        "dataset was generated with (dataset_uri), else on.",
        "section": SECTION_EVAL_CONDITIONS,
    },
    "concurrency": {
        "type": "array",
        "default": [1, PRODUCTION],
        "minItems": 1,
        "uniqueItems": True,
        "items": {"anyOf": [{"type": "integer", "minimum": 1, "maximum": 4096}, {"type": "string", "enum": [PRODUCTION]}]},
        "description": 'Requests in flight per server: integers, and/or "production" (the in-flight limit '
        "dflash_generate discovers from each server's live load). Acceptance falls with batch size on some engines.",
        "section": SECTION_EVAL_CONDITIONS,
    },
    "request_timeout_s": {
        "type": "number",
        "default": 600,
        "exclusiveMinimum": 0,
        "maximum": 86400,
        "description": "Floor of a request's deadline (as in dflash_generate).",
        "section": SECTION_EVAL_RUN,
    },
    "save_every": {
        "type": "integer",
        "default": 50,
        "minimum": 1,
        "maximum": 100000,
        "description": "Completions per part written to S3 (a killed task loses at most the parts not written).",
        "section": SECTION_EVAL_RUN,
    },
    "confidence": {
        "type": "number",
        "default": 0.95,
        "exclusiveMinimum": 0.5,
        "exclusiveMaximum": 1,
        "description": "Confidence level of the bootstrap intervals of acceptance length (BCa, rows resampled).",
        "section": SECTION_EVAL_RUN,
    },
}

REQUIRED_EVAL_PARAMS = ("output_uri", "drafters")

# The trigger form's essentials (config.run.form_layout puts them first; the rest is "Advanced: ...").
EVAL_ESSENTIAL_PARAMS: tuple[str, ...] = (
    "dataset_uri", "prompts_uri", "output_uri", "drafters", "baseline", "model", "max_prompts",
)


@dataclass(frozen=True)
class Group:
    """A set of servers serving the target with one speculative configuration (or none: baseline)."""

    name: str
    servers: tuple[str, ...]
    baseline: bool = False
    card_uri: str | None = None
    """The drafter's card (dflash_train): its lineage goes into the report."""

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"name": self.name, "servers": list(self.servers), "baseline": self.baseline}
        if self.card_uri:
            out["card_uri"] = self.card_uri
        return out


@dataclass(frozen=True)
class Condition:
    """One measuring condition; its name is the dataset's path segment under a group."""

    sampling: str  # "greedy" or "sampled"
    temperature: float
    top_p: float
    thinking: bool
    concurrency: int | None  # None = production (discovered)

    @property
    def name(self) -> str:
        c = "cprod" if self.concurrency is None else f"c{self.concurrency}"
        return f"{self.sampling}_think-{'on' if self.thinking else 'off'}_{c}"

    @property
    def concurrency_label(self) -> str:
        return PRODUCTION if self.concurrency is None else str(self.concurrency)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sampling": self.sampling, "temperature": self.temperature, "top_p": self.top_p,
                "thinking": self.thinking, "concurrency": self.concurrency_label}


@dataclass(frozen=True)
class EvalConfig:
    output_uri: str
    groups: tuple[Group, ...]  # drafters in the order given, then the baseline
    dataset_uri: str | None = None
    prompts_uri: str | None = None
    model: str | None = None
    max_tokens: int = 2048
    temperature: float = 0.6
    top_p: float = 0.95
    greedy: bool = True
    thinking_modes: tuple[str, ...] | None = None
    concurrency: tuple[int | str, ...] = (1, PRODUCTION)
    max_prompts: int | None = None
    request_timeout_s: float = 600.0
    save_every: int = 50
    confidence: float = 0.95
    aws_conn_id: str = "aws_default"
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def drafters(self) -> tuple[Group, ...]:
        return tuple(g for g in self.groups if not g.baseline)

    @property
    def baseline(self) -> Group | None:
        return next((g for g in self.groups if g.baseline), None)

    def group(self, name: str) -> Group:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)

    def group_uri(self, group: str, condition: str) -> str:
        return f"{self.output_uri}/{group}/{condition}"

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> EvalConfig:
        params = dict(params)
        unknown = sorted(set(params) - set(EVAL_PARAM_SCHEMAS))
        if unknown:
            raise ConfigError(f"unknown conf key(s) {unknown}; valid keys are {sorted(EVAL_PARAM_SCHEMAS)}")
        missing = [k for k in REQUIRED_EVAL_PARAMS if params.get(k) in (None, "", [])]
        if missing:
            raise ConfigError(f"required param(s) missing: {missing}")

        def get(name: str) -> Any:
            return params.get(name, EVAL_PARAM_SCHEMAS[name].get("default"))

        for name in ("dataset_uri", "prompts_uri", "output_uri", "max_prompts", "aws_conn_id", "model", "max_tokens",
                     "temperature", "top_p", "greedy", "request_timeout_s", "save_every"):
            if name in params:
                _check_schema(name, params[name], EVAL_PARAM_SCHEMAS[name])
        confidence = get("confidence")
        if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.5 < confidence < 1:
            raise ConfigError(f"param confidence: {confidence!r} must be a number between 0.5 and 1 (exclusive)")
        dataset_uri, prompts_uri = get("dataset_uri"), get("prompts_uri")
        if bool(dataset_uri) == bool(prompts_uri):
            raise ConfigError("give exactly one of dataset_uri (its held-out prompts) or prompts_uri (a benchmark "
                              f"file); got {'both' if dataset_uri else 'neither'}")
        try:
            out = parse_s3_uri(params["output_uri"], what="output_uri")
            src = parse_s3_uri(dataset_uri or prompts_uri, what="dataset_uri" if dataset_uri else "prompts_uri")
        except UriError as exc:
            raise ConfigError(str(exc)) from exc
        # The eval root may live under a dataset root (its keys never collide with a dataset's), but the
        # prompts may not live under the eval root, nor the eval root be the dataset itself.
        if src.bucket == out.bucket and (src.key == out.key or src.key.startswith(out.key + "/")):
            raise ConfigError(f"output_uri s3://{out.bucket}/{out.key} must not be or contain the prompt source "
                              f"s3://{src.bucket}/{src.key}")
        groups = [parse_group(d, f"drafters[{i}]", baseline=False)
                  for i, d in enumerate(_as_list(params["drafters"], "drafters"))]
        if len(groups) > EVAL_PARAM_SCHEMAS["drafters"]["maxItems"]:
            raise ConfigError(f"param drafters: at most {EVAL_PARAM_SCHEMAS['drafters']['maxItems']} drafters")
        if get("baseline") is not None:
            groups.append(parse_group(get("baseline"), "baseline", baseline=True))
        _check_groups(groups)
        thinking = get("thinking_modes")
        if thinking is not None:
            thinking = _as_list(thinking, "thinking_modes")
            if not thinking or any(t not in ("on", "off") for t in thinking) or len(set(thinking)) != len(thinking):
                raise ConfigError(f'param thinking_modes: {thinking!r} must be a non-empty list of distinct "on"/"off"')
        concurrency = _as_list(get("concurrency"), "concurrency")
        bad = [c for c in concurrency if not (c == PRODUCTION or (isinstance(c, int) and not isinstance(c, bool)
                                                                   and 1 <= c <= 4096))]
        if not concurrency or bad or len({str(c) for c in concurrency}) != len(concurrency):
            raise ConfigError(f'param concurrency: {concurrency!r} must be a non-empty list of distinct integers '
                              f'1-4096 and/or "{PRODUCTION}"' + (f" (bad: {bad!r})" if bad else ""))
        return cls(
            output_uri=f"s3://{out.bucket}/{out.key}",
            groups=tuple(groups),
            dataset_uri=f"s3://{src.bucket}/{src.key}" if dataset_uri else None,
            prompts_uri=prompts_uri,
            model=get("model"),
            max_tokens=int(get("max_tokens")),
            temperature=float(get("temperature")),
            top_p=float(get("top_p")),
            greedy=bool(get("greedy")),
            thinking_modes=tuple(thinking) if thinking is not None else None,
            concurrency=tuple(concurrency),
            max_prompts=get("max_prompts"),
            request_timeout_s=float(get("request_timeout_s")),
            save_every=int(get("save_every")),
            confidence=float(confidence),
            aws_conn_id=str(get("aws_conn_id")),
        )

    def conditions(self, dataset_thinking: bool | None = None) -> list[Condition]:
        """Every condition, in the order the servers run them: sampling (production first, then greedy),
        thinking mode, concurrency as listed. `dataset_thinking` is the mode the source dataset was
        generated with, used when thinking_modes is null."""
        if self.thinking_modes is not None:
            modes = [m == "on" for m in self.thinking_modes]
        else:
            modes = [True if dataset_thinking is None else bool(dataset_thinking)]
        samplings = [("sampled", self.temperature, self.top_p)]
        if self.greedy:
            samplings.append(("greedy", 0.0, 1.0))
        # temperature 0 given as the production temperature: one greedy condition, not two
        if self.greedy and self.temperature == 0:
            samplings = samplings[1:]
        return [Condition(name, t, p, think, None if c == PRODUCTION else int(c))
                for name, t, p in samplings for think in modes for c in self.concurrency]

    def run_config(self, group: Group, condition: Condition, prompts_uri: str) -> RunConfig:
        """The generate RunConfig of one (group, condition) dataset: derived, not copied."""
        params: dict[str, Any] = {
            "prompts_uri": prompts_uri,
            "output_uri": self.group_uri(group.name, condition.name),
            "servers": list(group.servers),
            "model": self.model,
            "max_tokens": self.max_tokens,
            "temperature": condition.temperature,
            "top_p": condition.top_p,
            "enable_thinking": condition.thinking,
            "concurrency_per_server": condition.concurrency,
            "save_every": self.save_every,
            "request_timeout_s": self.request_timeout_s,
            "limit": self.max_prompts,
            "aws_conn_id": self.aws_conn_id,
            # An eval measures what the servers do: an error or a cut-off answer is a row to count,
            # never a reason to stop measuring the others.
            "max_error_rate": 1.0,
            "max_truncation_rate": 1.0,
            "max_missing_reasoning_rate": 1.0,
        }
        assert set(params) <= set(PARAM_SCHEMAS)
        return RunConfig.from_params(params)

    def to_dict(self) -> dict[str, Any]:
        return {
            "output_uri": self.output_uri, "dataset_uri": self.dataset_uri, "prompts_uri": self.prompts_uri,
            "groups": [g.to_dict() for g in self.groups], "model": self.model, "max_tokens": self.max_tokens,
            "temperature": self.temperature, "top_p": self.top_p, "greedy": self.greedy,
            "thinking_modes": list(self.thinking_modes) if self.thinking_modes else None,
            "concurrency": list(self.concurrency), "max_prompts": self.max_prompts, "confidence": self.confidence,
        }


def _as_list(value: Any, name: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"param {name}: {value!r} is not a list")
    return list(value)


def parse_group(value: Any, where: str, *, baseline: bool) -> Group:
    """One {"name", "servers"} object, with a message that says which one is wrong and why."""
    example = '{"name": "eagle3-a", "servers": ["http://gpu0:30000"]}'
    if not isinstance(value, dict):
        raise ConfigError(f"param {where}: {value!r} is not an object like {example}")
    extra = sorted(set(value) - {"name", "servers", "card_uri"})
    if extra:
        raise ConfigError(f"param {where}: unknown key(s) {extra}; a group has only 'name', 'servers' and "
                          "'card_uri'")
    name = value.get("name")
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ConfigError(f"param {where}.name: {name!r} must be 1-64 letters, digits, '.', '_' or '-' "
                          "(it is an S3 path segment), starting with a letter or digit")
    servers = value.get("servers")
    if not isinstance(servers, (list, tuple)) or not servers:
        raise ConfigError(f"param {where} ({name}): servers must be a non-empty list of base URLs or connection ids")
    if any(not isinstance(s, str) or not s.strip() for s in servers):
        raise ConfigError(f"param {where} ({name}): every server must be a non-empty string, got {servers!r}")
    if len(set(servers)) != len(servers):
        raise ConfigError(f"param {where} ({name}): a server is listed twice in {servers!r}")
    card_uri = value.get("card_uri")
    if card_uri is not None:
        if baseline:
            raise ConfigError(f"param {where} ({name}): the baseline serves no drafter, so it has no card_uri")
        try:
            parse_s3_uri(card_uri, what=f"param {where}.card_uri")
        except UriError as exc:
            raise ConfigError(str(exc)) from exc
    return Group(name=name, servers=tuple(servers), baseline=baseline, card_uri=card_uri)


def _check_groups(groups: list[Group]) -> None:
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"group name(s) {dup} used twice: every drafter (and the baseline) needs its own name")
    owner: dict[str, str] = {}
    for g in groups:
        for s in g.servers:
            key = s.rstrip("/")
            if key in owner:
                raise ConfigError(f"server {s!r} is in both {owner[key]!r} and {g.name!r}: a server runs one "
                                  "speculative configuration, so it belongs to one group")
            owner[key] = g.name
