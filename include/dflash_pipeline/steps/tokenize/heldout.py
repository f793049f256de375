"""Tokenize's guard on the held-out split: no held-out conversation reaches a shard, whatever is in
the completions.

Plan already leaves held-out prompts out of generation; this is the second line, for what plan could
not see: a dataset planned before the split existed, a completions part copied in from elsewhere, or a
benchmark named only now. The held-out ids are

* the manifest's split (`manifest["heldout"]`): its fraction and salt (the hash rule) and the ids in
  the held-out prompts file plan wrote (which also holds the ids of the plan's `heldout_uri`), and
* the tokenize run's own `heldout_uri` (a file of ids or prompt rows, `dataset.heldout` reads it),
  pinned with the other tokenize settings so every shard of a dataset is cut the same way.

A completion row whose id is held out is dropped before its turns are built, counted by reason
`heldout` (one per training row it would have made: one per row here, as its turns are never built).
"""

from __future__ import annotations

import io
import logging
from typing import Any

import pyarrow as pa

from dflash_pipeline.config import ConfigError
from dflash_pipeline.dataset.heldout import DEFAULT_SALT, HeldoutSplit, read_heldout_ids
from dflash_pipeline.dataset.layout import DatasetLayout, UriError, parse_s3_uri
from dflash_pipeline.dataset.prompts import PromptFileError
from dflash_pipeline.dataset.store import Store, with_retries

logger = logging.getLogger(__name__)

DROP_HELDOUT = "heldout"


def _read_ids(store: Store, key: str, what: str) -> frozenset[str]:
    got = with_retries(lambda: store.get(key), what=f"read {what}")
    if got is None:
        raise ConfigError(f"{what} s3://{store.bucket}/{key} does not exist")
    try:
        return read_heldout_ids(io.BytesIO(got[0]), key)
    except (PromptFileError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} s3://{store.bucket}/{key}: {exc}") from exc


def load_heldout(client: Any, layout: DatasetLayout, manifest: dict[str, Any] | None,
                 heldout_uri: str | None) -> HeldoutSplit:
    """The held-out split tokenize enforces for one dataset (inactive when there is none)."""
    entry = (manifest or {}).get("heldout") or {}
    ids: set[str] = set()
    if entry.get("key"):
        ids |= _read_ids(Store(client, layout.bucket), entry["key"], "the dataset's held-out prompts")
    if heldout_uri:
        try:
            src = parse_s3_uri(heldout_uri, what="heldout_uri")
        except UriError as exc:
            raise ConfigError(str(exc)) from exc
        ids |= _read_ids(Store(client, src.bucket), src.key, "heldout_uri")
    split = HeldoutSplit(float(entry.get("fraction") or 0.0), str(entry.get("salt") or DEFAULT_SALT),
                         frozenset(ids), heldout_uri)
    if split.active:
        logger.info("%s: refusing held-out conversations (fraction %s, salt %r, %d named ids)", layout.uri,
                    split.fraction, split.salt, len(split.ids))
    return split


def drop_heldout(table: pa.Table, split: HeldoutSplit) -> tuple[pa.Table, int]:
    """(the completion rows that are not held out, how many were)."""
    if not split.active or table.num_rows == 0:
        return table, 0
    keep = [not split.holds(i) for i in table.column("id").to_pylist()]
    dropped = keep.count(False)
    if dropped == 0:
        return table, 0
    return table.filter(pa.array(keep, type=pa.bool_())), dropped


def split_summary(split: HeldoutSplit, manifest: dict[str, Any] | None) -> dict[str, Any] | None:
    """What the report and the card say about the split (None when there is none)."""
    entry = (manifest or {}).get("heldout")
    if not split.active and not entry:
        return None
    out = dict(entry or {})
    out["tokenize_heldout_uri"] = split.uri
    return out
