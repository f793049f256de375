"""The per-row checks of validation, vectorised over one part at a time with pyarrow/numpy.

Memory holds one chunk, fixed-size histograms and an 8-byte hash per row (to tell a duplicate in
another part from an id that was never planned); id lists spool to temporary files.
"""

from __future__ import annotations

import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from typing import IO, Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dflash_pipeline.dataset.records import unit_keys
from dflash_pipeline.steps.validate.digest import stable_hash
from dflash_pipeline.steps.validate.histogram import Histogram
from dflash_pipeline.steps.validate.tally import (
    LIST_LIMIT,
    MAX_FINISH_KEYS,
    SAMPLE_LIMIT,
    RecountTally,
    ServerTally,
    Tally,
)

logger = logging.getLogger(__name__)




class IdSpool:
    """Ids written one per line to a temporary file (all of them) with the first few kept in memory."""

    def __init__(self, keep: list[str]) -> None:
        self.keep = keep
        self.count = 0
        self._fh: IO[bytes] = tempfile.TemporaryFile(prefix="dflash-ids-")

    def add(self, ids: Iterable[str]) -> None:
        lines = []
        for pid in ids:
            self.count += 1
            if len(self.keep) < LIST_LIMIT:
                self.keep.append(pid)
            # One id per line; an id holding a line break is written JSON-quoted.
            lines.append(json.dumps(pid) if ("\n" in pid or "\r" in pid) else pid)
        if lines:
            self._fh.write(("\n".join(lines) + "\n").encode())

    def lines(self) -> Iterator[str]:
        self._fh.flush()
        self._fh.seek(0)
        for raw in self._fh:
            line = raw.decode().rstrip("\n")
            yield json.loads(line) if line.startswith('"') else line

    def file(self) -> IO[bytes]:
        self._fh.flush()
        self._fh.seek(0)
        return self._fh

    def close(self) -> None:
        self._fh.close()


def to_numpy(arr: pa.ChunkedArray | pa.Array, fill: Any) -> np.ndarray:
    return pc.fill_null(arr, fill).to_numpy(zero_copy_only=False)


def unfinished_mask(tbl: pa.Table) -> np.ndarray:
    """Rows without an error class whose finish_reason is not stop/length (never a completion)."""
    finish = pc.fill_null(tbl.column("finish_reason"), "")
    ok = pc.or_(pc.equal(finish, "stop"), pc.equal(finish, "length"))
    return ~to_numpy(ok, False).astype(bool)


class Validator:
    """Folds chunks (planned ids + the part's rows) into a Tally; `finish()` resolves cross-part ids."""

    def __init__(self, thinking: bool, recounter: Any = None) -> None:
        self.t = Tally()
        self.thinking = thinking
        self.recounter = recounter
        if recounter is not None:
            self.t.recount = RecountTally(
                tokenizer=recounter.files.spec, chat_template=recounter.template_source
            )
            self.t.think_vs_answer_unit = "tokens (training tokenizer)"
        self.missing = IdSpool(self.t.missing_ids)
        self.duplicates = IdSpool(self.t.duplicate_ids)
        self.unexpected = IdSpool(self.t.unexpected_ids)
        self._foreign = IdSpool([])
        self._valid_hashes: list[np.ndarray] = []

    def close(self) -> None:
        for spool in (self.missing, self.duplicates, self.unexpected, self._foreign):
            spool.close()

    # -- coverage ------------------------------------------------------------------------------
    def add_chunk(self, planned_ids: list[str], part: pa.Table | None) -> None:
        """One planned chunk and its part (None when the part is absent): its digest, folded in.

        Ids are unit keys (`records.unit_key`): one row per (id, sample), sample 0 being the bare id."""
        from dflash_pipeline.steps.validate.digest import DigestContext, make_digest, missing_digest

        ctx = DigestContext(plan_id="", thinking=self.thinking, recounter=self.recounter)
        self.add_digest(missing_digest(planned_ids, 0, ctx) if part is None
                        else make_digest(part, planned_ids, 0, "", ctx))

    def add_digest(self, d: Any) -> None:
        """One chunk's digest (digest.py): its coverage lists, then its rows' checks."""
        t = self.t
        meta = d.meta
        t.prompts += int(meta["planned"])
        lacking = meta["missing"]
        if meta.get("absent"):
            t.missing += len(lacking)
            self.missing.add(lacking)
            return
        t.parts_present += 1
        if meta["duplicates"]:
            t.duplicates += len(meta["duplicates"])
            self.duplicates.add(meta["duplicates"])
        if meta["foreign"]:
            self._foreign.add(meta["foreign"])
        if lacking:
            t.missing += len(lacking)
            self.missing.add(lacking)
        tbl = d.table
        self._valid_hashes.append(to_numpy(tbl.column("d_key_hash"), 0).astype(np.int64))
        if tbl.num_rows:
            self._tally_rows(tbl)
            rc = meta.get("recount")
            if self.t.recount is not None and rc:
                self.t.recount.rows_encoded_alone += int(rc.get("rows_encoded_alone", 0))
                self.t.recount.seconds += float(rc.get("recount_seconds", 0.0))

    def finish(self) -> Tally:
        """Sort rows whose id was not planned in their part's chunk: a copy of a row kept elsewhere is
        a duplicate, anything else is unexpected (never planned, or misplaced and missing at home)."""
        if self._foreign.count:
            valid = np.sort(np.concatenate(self._valid_hashes)) if self._valid_hashes else np.zeros(0, np.int64)
            batch: list[str] = []

            def flush() -> None:
                h = stable_hash(batch)
                pos = np.minimum(np.searchsorted(valid, h), max(len(valid) - 1, 0))
                is_dup = (valid[pos] == h) if len(valid) else np.zeros(len(batch), dtype=bool)
                dup_ids = [p for p, d in zip(batch, is_dup) if d]
                other = [p for p, d in zip(batch, is_dup) if not d]
                self.t.duplicates += len(dup_ids)
                self.duplicates.add(dup_ids)
                self.t.unexpected += len(other)
                self.unexpected.add(other)
                batch.clear()

            for pid in self._foreign.lines():
                batch.append(pid)
                if len(batch) >= 100_000:
                    flush()
            if batch:
                flush()
        self._valid_hashes = []
        return self.t

    # -- per-row checks (vectorised) -------------------------------------------------------------
    def _tally_rows(self, tbl: pa.Table) -> None:
        t = self.t
        if "sample" in tbl.column_names:
            for k, cnt in zip(*value_counts(pc.fill_null(tbl.column("sample"), 0))):
                t.samples[int(k)] += cnt
        else:
            t.samples[0] += tbl.num_rows
        servers = np.asarray(pc.fill_null(tbl.column("server"), "?").to_pylist(), dtype=object)
        is_err = to_numpy(pc.greater(pc.binary_length(tbl.column("error_class")), 0), False)
        unfinished = unfinished_mask(tbl) & ~is_err
        n_unfinished = int(unfinished.sum())
        if n_unfinished:
            t.unfinished_as_completions += n_unfinished
            if len(t.defect_ids.get("unfinished_as_completions", [])) < SAMPLE_LIMIT:
                pids = tbl.column("id").to_pylist()
                t.sample("unfinished_as_completions", (pids[i] for i in np.flatnonzero(unfinished)[:SAMPLE_LIMIT]))
            t.errors += n_unfinished
            t.retryable_errors += n_unfinished
            t.errors_by_class["Unfinished"] += n_unfinished
            is_err_all = is_err | unfinished
        else:
            is_err_all = is_err
        for name in set(servers.tolist()):
            st = t.per_server.setdefault(name, ServerTally())
            mask = servers == name
            st.rows += int(mask.sum())
            st.errors += int((mask & is_err_all).sum())
        n_err = int(is_err.sum())
        if n_err:
            errs = tbl.filter(pa.array(is_err))
            t.errors += n_err
            for cls, cnt in zip(*value_counts(errs.column("error_class"))):
                t.errors_by_class[cls] += cnt
            t.retryable_errors += int(to_numpy(errs.column("retryable"), False).sum())
        if n_err or n_unfinished:
            tbl = tbl.filter(pa.array(~is_err_all))
            servers = servers[~is_err_all]
        m = tbl.num_rows
        if m == 0:
            return
        t.completions += m
        ids: list[str] | None = None

        def id_list() -> list[str]:
            nonlocal ids
            if ids is None:
                ids = tbl.column("id").to_pylist()
            return ids

        def flag(check: str, mask: np.ndarray) -> int:
            k = int(mask.sum())
            if k and len(t.defect_ids.get(check, [])) < SAMPLE_LIMIT:
                pids = id_list()
                t.sample(check, (pids[i] for i in np.flatnonzero(mask)[:SAMPLE_LIMIT]))
            return k

        finish = np.asarray(pc.fill_null(tbl.column("finish_reason"), "null").to_pylist(), dtype=object)
        empty = to_numpy(tbl.column("d_empty"), True).astype(bool)
        has_reasoning = to_numpy(tbl.column("d_has_reasoning"), False).astype(bool)
        truncated = finish == "length"

        t.truncated += int(truncated.sum())
        t.truncated_in_thinking += flag("truncated_in_thinking", truncated & empty)
        t.truncated_in_answer += int((truncated & ~empty).sum())
        t.empty_content += int(empty.sum())
        t.empty_content_not_truncated += flag("empty_content_not_truncated", empty & ~truncated)
        # Each row's thinking mode (a mixed run's rows differ); rows written before the column: the run's.
        if "thinking" in tbl.column_names:
            thinks = to_numpy(tbl.column("thinking"), self.thinking).astype(bool)
        else:
            thinks = np.full(m, self.thinking, dtype=bool)
        t.completions_thinking += int(thinks.sum())
        missing = thinks & ~has_reasoning
        t.reasoning_missing += flag("reasoning_missing", missing)
        for name in set(servers[missing].tolist()):
            t.per_server[name].reasoning_missing += int(((servers == name) & missing).sum())
        t.reasoning_unexpected += flag("reasoning_unexpected", ~thinks & has_reasoning)
        t.think_markers_in_content += flag("think_markers_in_content", to_numpy(tbl.column("d_markers_content"), False))
        if has_reasoning.any():
            t.think_markers_in_reasoning += flag("think_markers_in_reasoning",
                                                 to_numpy(tbl.column("d_markers_reasoning"), False))

        pt_col, ct_col, rt_col = (tbl.column(c) for c in ("prompt_tokens", "completion_tokens", "reasoning_tokens"))
        pt, ct, rt = to_numpy(pt_col, 0).astype(np.int64), to_numpy(ct_col, 0).astype(np.int64), to_numpy(rt_col, 0).astype(np.int64)
        ct_ok = to_numpy(pc.is_valid(ct_col), False)
        rt_ok = to_numpy(pc.is_valid(rt_col), False)
        t.usage_missing += flag("usage_missing", ~ct_ok)
        t.prompt_tokens += int(pt.sum())
        t.output_tokens += int(ct.sum())
        t.reasoning_tokens += int(rt[rt_ok].sum())
        t.reasoning_tokens_reported += int(rt_ok.sum())
        t.reasoning_tokens_unreported += int((has_reasoning & (~rt_ok | (rt == 0))).sum())
        t.prompt_hist.add(pt[to_numpy(pc.is_valid(pt_col), False)])
        t.output_hist.add(ct[ct_ok])
        t.reasoning_hist.add(rt[rt_ok])
        for name, cnt in Counter(finish.tolist()).items():
            t.finish_reasons[name] += cnt
            key = name if name in t.by_finish or len(t.by_finish) < MAX_FINISH_KEYS else "other"
            t.by_finish.setdefault(key, Histogram()).add(ct[(finish == name) & ct_ok])

        self._tally_turns(tbl)
        latency = to_numpy(tbl.column("latency_s"), 0.0).astype(np.float64)
        for name in set(servers.tolist()):
            mask = servers == name
            st = t.per_server[name]
            st.completions += int(mask.sum())
            st.truncated += int((mask & truncated).sum())
            st.prompt_tokens += int(pt[mask].sum())
            st.output_tokens += int(ct[mask].sum())
            st.latency_sum += float(latency[mask].sum())

        if self.t.recount is not None and "rc_training" in tbl.column_names:
            thinking_n, answer_n = self._recount(tbl, ct, ct_ok, has_reasoning, id_list, thinks)
            t.think_vs_answer.add(thinking_n, answer_n)
        else:
            split = rt_ok & ct_ok & ((rt > 0) | ~has_reasoning)
            t.think_vs_answer_skipped += int((~split).sum())
            t.think_vs_answer.add(rt[split], (ct - rt)[split])

    def _tally_turns(self, tbl: pa.Table) -> None:
        """Turns generated, conversations cut short (by reason), cached prompt tokens (completions)."""
        t = self.t
        names = tbl.column_names
        if "turns" in names:
            lens = to_numpy(pc.list_value_length(tbl.column("turns")), 1).astype(np.int64)
            lens[lens == 0] = 1  # a row written before turns were recorded is one turn
            t.turns_generated += int(lens.sum())
            t.multi_turn_rows += int((lens > 1).sum())
        else:
            t.turns_generated += tbl.num_rows
        if "cut_short" in names and tbl.column("cut_short").null_count < tbl.num_rows:
            for reason, cnt in zip(*value_counts(tbl.column("cut_short").drop_null())):
                t.cut_short[reason] += cnt
        if "cached_tokens" in names:
            col = tbl.column("cached_tokens")
            t.cached_tokens_reported += tbl.num_rows - col.null_count
            t.cached_prompt_tokens += int(to_numpy(col, 0).astype(np.int64).sum())
        self._tally_engine_ids(tbl)

    def _tally_engine_ids(self, tbl: pa.Table) -> None:
        """Completions with and without the engine's token ids (what tokenization builds rows from), and
        turns whose stored generated ids disagree with the server's own `completion_tokens`."""
        t = self.t
        col = tbl.column("d_ids_lens")
        has = to_numpy(pc.is_valid(col), False)
        t.rows_with_engine_ids += int(has.sum())
        t.rows_without_engine_ids += int((~has).sum())
        if not has.any() or "turns" not in tbl.column_names:
            return
        sub = tbl.filter(pa.array(has))
        lens, turns = sub.column("d_ids_lens"), sub.column("turns")
        same_shape = to_numpy(pc.equal(pc.list_value_length(lens), pc.list_value_length(turns)), False)
        if not same_shape.all():
            t.engine_ids_disagree += flag_ids(t, "engine_ids_disagree_with_usage", sub, ~same_shape)
            sub = sub.filter(pa.array(same_shape))
            lens, turns = sub.column("d_ids_lens"), sub.column("turns")
        got = to_numpy(pc.list_flatten(lens), -1).astype(np.int64)
        want = to_numpy(pc.struct_field(pc.list_flatten(turns), "completion_tokens"), -2).astype(np.int64)
        bad_turn = (got >= 0) & (got != want)
        if bad_turn.any():
            per_row = np.add.reduceat(bad_turn.astype(np.int64), _starts(turns)) if len(bad_turn) else bad_turn
            t.engine_ids_disagree += flag_ids(t, "engine_ids_disagree_with_usage", sub, per_row > 0)

    def _recount(
        self, tbl: pa.Table, ct: np.ndarray, ct_ok: np.ndarray, has_reasoning: np.ndarray, id_list: Any,
        thinks: np.ndarray | None = None,
    ) -> tuple[np.ndarray, np.ndarray]:
        """Fold the digest's recount columns (digest.py computed them with the training tokenizer)."""
        rc = self.t.recount
        assert rc is not None
        if "turns" in tbl.column_names:
            last_ct = [(ts[-1].get("completion_tokens") if ts else None) for ts in tbl.column("turns").to_pylist()]
            has_last = np.array([v is not None for v in last_ct], dtype=bool)
            ct = np.where(has_last, np.array([v or 0 for v in last_ct], dtype=np.int64), ct)
        reasoning_n = to_numpy(tbl.column("rc_reasoning"), 0).astype(np.int64)
        content_n = to_numpy(tbl.column("rc_content"), 0).astype(np.int64)
        out = reasoning_n + content_n
        rc.rows += len(out)
        rc.compared += int(ct_ok.sum())
        rc.output_tokens += int(out.sum())
        rc.output_tokens_server += int(ct[ct_ok].sum())
        rc.reasoning_tokens += int(reasoning_n.sum())
        rc.content_tokens += int(content_n.sum())
        rc.training.add(to_numpy(tbl.column("rc_training"), 0).astype(np.int64))
        delta = ct - out
        bad = ct_ok & ((delta < 0) | (delta > self.recounter.allowed_overhead(has_reasoning)))
        k = int(bad.sum())
        if k:
            rc.mismatches += k
            rc.max_abs_delta = max(rc.max_abs_delta, int(np.abs(delta[bad]).max()))
            if len(rc.mismatch_ids) < SAMPLE_LIMIT:
                pids = id_list()
                rc.mismatch_ids.extend(pids[i] for i in np.flatnonzero(bad)[: SAMPLE_LIMIT - len(rc.mismatch_ids)])
        return reasoning_n, content_n


def template_messages(tbl: pa.Table) -> list[list[dict[str, Any]] | None]:
    """What a trainer renders before the last answer: the regenerated conversation up to its last turn
    when the part has it (its own tokens are compared with that turn's server count), else `messages`."""
    messages = tbl.column("messages").to_pylist() if "messages" in tbl.column_names else [None] * tbl.num_rows
    if "conversation" in tbl.column_names:
        for i, conv in enumerate(tbl.column("conversation").to_pylist()):
            if conv:
                messages[i] = [_template_message(m) for m in conv[:-1]]
    return messages


def _template_message(m: dict[str, Any]) -> dict[str, Any]:
    """A `conversation` entry as chat templates take it (reasoning as `reasoning_content`)."""
    out = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("reasoning"):
        out["reasoning_content"] = m["reasoning"]
    return out


def _starts(lists: pa.ChunkedArray) -> np.ndarray:
    """Start index of each row's items in the flattened list column (rows with at least one item)."""
    lens = to_numpy(pc.list_value_length(lists), 0).astype(np.int64)
    return np.concatenate([[0], np.cumsum(lens)[:-1]])


def flag_ids(t: Tally, check: str, tbl: pa.Table, mask: np.ndarray) -> int:
    """Count rows of `tbl` selected by `mask` and keep the first of their keys as the check's sample."""
    if mask.any():
        picked = tbl.filter(pa.array(mask))
        t.sample(check, unit_keys(picked.column("id").to_pylist(),
                                  picked.column("sample").to_pylist() if "sample" in picked.column_names else None))
    return int(mask.sum())


def value_counts(col: pa.ChunkedArray) -> tuple[list[str], list[int]]:
    vc = pc.value_counts(col)
    return vc.field("values").to_pylist(), vc.field("counts").to_pylist()


