"""Where everything lives under a dataset root (`output_uri`).

Every key is a pure function of the dataset root and a chunk index, never of the clock, so a retried
task writes to exactly the keys its first try would have written. The layout is documented in
docs/architecture.md (tests/integrity/test_readme.py keeps the docs to these keys); readers downstream only need `manifest.json` and `completions/`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

_BUCKET_RE = re.compile(r"^[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]$")
_SAFE_SEGMENT_RE = re.compile(r"^[A-Za-z0-9._=\-]+$")
_RUN_ID_UNSAFE = re.compile(r"[^A-Za-z0-9._\-]")

CHUNK_DIGITS = 6
DEFAULT_TOKENIZATION = "default"
"""The tokenization whose files sit directly under tokenized/ (the first one; the only one before names)."""
TOKENIZED_RESERVED = frozenset({"parquet", "specforge", "specforge-conversations", "speculators", "stats"})
"""Folders of the default tokenization under tokenized/: no named tokenization may take these names."""
TOKENIZATION_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_\-]{0,62}$")


class UriError(ValueError):
    """An S3 URI that cannot be used (wrong scheme, bad bucket, unsafe path)."""


@dataclass(frozen=True)
class S3Uri:
    bucket: str
    key: str

    def __str__(self) -> str:
        return f"s3://{self.bucket}/{self.key}"


def parse_s3_uri(uri: str, *, what: str = "uri", allow_empty_key: bool = False) -> S3Uri:
    """Parse and sanity-check `s3://bucket/key`, refusing paths that could escape a prefix."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise UriError(f"{what} must look like s3://bucket/key, got {uri!r}")
    rest = uri[len("s3://") :]
    bucket, _, key = rest.partition("/")
    if not _BUCKET_RE.match(bucket):
        raise UriError(f"{what}: {bucket!r} is not a valid S3 bucket name")
    key = key.strip("/")
    if not key and not allow_empty_key:
        raise UriError(f"{what} must name a key under the bucket, got {uri!r}")
    for segment in key.split("/") if key else []:
        if segment in ("", ".", "..") or not _SAFE_SEGMENT_RE.match(segment):
            raise UriError(
                f"{what}: path segment {segment!r} in {uri!r} is not allowed "
                "(use letters, digits, '.', '_', '-', '='; no empty, '.' or '..' segments)"
            )
    return S3Uri(bucket, key)


def safe_run_id(run_id: str) -> str:
    """A run id as a single safe key segment (Airflow run ids contain ':' and '+')."""
    cleaned = _RUN_ID_UNSAFE.sub("_", run_id)
    return cleaned[:200] or "run"


@dataclass(frozen=True)
class DatasetLayout:
    """All keys of one dataset root. `root` has no trailing slash. `tokenization` names the tokenization the
    tokenized_* keys belong to: None or "default" = directly under tokenized/, else tokenized/<name>/."""

    bucket: str
    root: str
    tokenization: str | None = None

    def tokenized_as(self, name: str | None) -> "DatasetLayout":
        """This layout with the tokenized_* keys of tokenization `name`."""
        return replace(self, tokenization=None if name in (None, DEFAULT_TOKENIZATION) else name)

    @property
    def tokenized_dir(self) -> str:
        """The tokenization's folder relative to the root: tokenized, or tokenized/<name>."""
        return "tokenized" if self.tokenization is None else f"tokenized/{self.tokenization}"

    @classmethod
    def from_uri(cls, output_uri: str) -> "DatasetLayout":
        parsed = parse_s3_uri(output_uri, what="output_uri")
        return cls(parsed.bucket, parsed.key)

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.root}"

    def _k(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    @property
    def manifest_key(self) -> str:
        return self._k("manifest.json")

    @property
    def report_key(self) -> str:
        return self._k("report.json")

    @property
    def report_md_key(self) -> str:
        return self._k("report.md")

    @property
    def inputs_prefix(self) -> str:
        return self._k("inputs/")

    @property
    def completions_prefix(self) -> str:
        return self._k("completions/")

    @property
    def claims_prefix(self) -> str:
        return self._k("claims/")

    @property
    def partials_prefix(self) -> str:
        return self._k("partials/")

    def partial_key(self, chunk: int) -> str:
        """Rows of an unfinished chunk saved by a worker that gave up, for whoever takes it over."""
        return f"{self.partials_prefix}chunk-{chunk:0{CHUNK_DIGITS}d}.parquet"

    @property
    def retry_prefix(self) -> str:
        return self._k("retry/")

    def retry_key(self, chunk: int) -> str:
        """A marker: this chunk's part holds error rows a later run should try again."""
        return f"{self.retry_prefix}chunk-{chunk:0{CHUNK_DIGITS}d}.json"

    @property
    def rejects_key(self) -> str:
        return self._k("rejects/rejects.jsonl")

    @property
    def quality_signals_key(self) -> str:
        """Every completion's quality signals as columns (id, sample, q_*, language, flags, duplicate_of),
        written by validation; rewritten whole (same parts and settings, same bytes)."""
        return self._k("quality/signals.parquet")

    @property
    def near_duplicates_key(self) -> str:
        """Near-duplicate prompts found at validation (id, duplicate_of, similarity); rewritten whole."""
        return self._k("quality/near_duplicates.parquet")

    @property
    def near_duplicates_meta_key(self) -> str:
        """What near_duplicates.parquet was computed from (plan_id, settings), next to it."""
        return self._k("quality/near_duplicates.json")

    @property
    def digests_prefix(self) -> str:
        return self._k("digests/")

    def digest_key(self, chunk: int) -> str:
        """Part N's digest: its validation counts, token figures and quality signals (no text), written
        after the part by whoever computed it (the generate worker that committed it, or validation);
        a pure function of the part, its plan and the settings, so a rewrite writes the same bytes."""
        return f"{self.digests_prefix}part-{chunk:0{CHUNK_DIGITS}d}.parquet"

    def live_quality_key(self, run_id: str, worker: str) -> str:
        """A generate task's live quality figures over the parts it committed in this run."""
        return self.run_key(run_id, f"quality/{worker}.json")

    @property
    def heldout_prefix(self) -> str:
        return self._k("heldout/")

    @property
    def heldout_prompts_key(self) -> str:
        """The held-out prompts plan kept out of the dataset, in the input format (a prompts_uri)."""
        return self._k("heldout/prompts.jsonl.gz")

    def input_key(self, plan_id: str, chunk: int) -> str:
        return f"{self.inputs_prefix}{plan_id}/chunk-{chunk:0{CHUNK_DIGITS}d}.parquet"

    def part_key(self, chunk: int) -> str:
        return f"{self.completions_prefix}part-{chunk:0{CHUNK_DIGITS}d}.parquet"

    def claim_key(self, chunk: int) -> str:
        return f"{self.claims_prefix}chunk-{chunk:0{CHUNK_DIGITS}d}.json"

    # -- tokenize step (dflash_tokenize): one output part per completions part, same index --------
    @property
    def tokenized_prefix(self) -> str:
        return self._k(f"{self.tokenized_dir}/")

    @property
    def tokenizations_prefix(self) -> str:
        """Where every tokenization lives (the default's files, and one folder per named one)."""
        return self._k("tokenized/")

    def key(self, relative: str) -> str:
        """The key of a path relative to the dataset root (the tokenize profiles' files: a path under
        tokenized/ goes to this layout's tokenization)."""
        if relative.startswith("tokenized/"):
            relative = f"{self.tokenized_dir}/{relative[len('tokenized/'):]}"
        return self._k(relative)

    @property
    def tokenized_stats_prefix(self) -> str:
        return self._k(f"{self.tokenized_dir}/stats/")

    def tokenized_stats_key(self, chunk: int) -> str:
        """The commit point of a tokenized part: written last (after every profile's file), If-None-Match."""
        return f"{self.tokenized_stats_prefix}part-{chunk:0{CHUNK_DIGITS}d}.json"

    @property
    def tokenized_settings_key(self) -> str:
        """The settings the shards were made with (pinned by the first run)."""
        return self._k(f"{self.tokenized_dir}/settings.json")

    @property
    def tokenized_report_key(self) -> str:
        return self._k(f"{self.tokenized_dir}/report.json")

    @property
    def tokenized_report_md_key(self) -> str:
        return self._k(f"{self.tokenized_dir}/report.md")

    @property
    def dataset_card_key(self) -> str:
        """README.md at the dataset root: the dataset card (what Hugging Face `datasets` reads)."""
        return self._k("README.md")

    def run_key(self, run_id: str, name: str) -> str:
        return self._k(f"runs/{safe_run_id(run_id)}/{name}")

    def progress_key(self, run_id: str, worker: str) -> str:
        return self.run_key(run_id, f"progress/{worker}.json")

    def failure_key(self, run_id: str, task_id: str, map_index: int, try_number: int) -> str:
        """One failed try's reason (monitor/failures.py), for the run's page."""
        name = task_id if map_index < 0 else f"{task_id}-{map_index}"
        return self.run_key(run_id, f"failures/{name}-try{try_number}.json")


_INDEXED_RE = re.compile(r"(?:chunk|part)-(\d+)\.(?:parquet|jsonl|json)")


def chunk_of_key(key: str, prefix: str) -> int | None:
    """The chunk index of a part/claim/input key directly under `prefix`, or None for anything else.

    Anchored: `completions/old/part-000003.parquet` or `completions/part-3.parquet.bak` is not chunk 3."""
    if not key.startswith(prefix):
        return None
    m = _INDEXED_RE.fullmatch(key[len(prefix):])
    return int(m.group(1)) if m else None
