"""Chunk layout (guided self-scheduling tail) and pin comparison."""

from __future__ import annotations

import pytest

from dflash_pipeline.config import RunConfig
from dflash_pipeline.dataset.prompts import Prompt
from dflash_pipeline.steps.plan import PlanError, _Deduper, check_pins, chunk_sizes, chunk_stream, pinned_settings


@pytest.mark.parametrize(("n", "save_every", "servers"), [(1, 500, 7), (902_087, 500, 7), (8000, 100, 4), (999, 10, 3), (50, 500, 1)])
def test_chunks_cover_every_prompt_and_shrink_at_the_end(n: int, save_every: int, servers: int) -> None:
    sizes = chunk_sizes(n, save_every, servers)
    assert sum(sizes) == n
    assert max(sizes) <= save_every
    assert sizes == sorted(sizes, reverse=True), "big chunks first, the small ones last"
    if n >= 4 * servers * save_every:
        assert sizes[0] == save_every
        assert sizes[-1] < save_every, "the tail is cut finer"


def test_full_size_layout_is_small() -> None:
    sizes = chunk_sizes(902_087, 500, 7)
    assert 1800 <= len(sizes) <= 1900
    assert sizes.count(500) >= 1790


def test_streaming_matches_the_layout() -> None:
    prompts = [Prompt(str(i), [{"role": "user", "content": str(i)}], bytes(16), i) for i in range(2345)]
    chunks = list(chunk_stream(iter(prompts), 50, 3))
    assert [len(c) for c in chunks] == chunk_sizes(2345, 50, 3)
    assert [p.id for c in chunks for p in c] == [p.id for p in prompts]


def test_deduper() -> None:
    d = _Deduper()
    p = lambda pid, h: Prompt(pid, [], h, 1)  # noqa: E731
    assert d.check(p("a", b"1")) is None
    assert d.check(p("a", b"1")) == "duplicate"
    assert d.check(p("b", b"1")) == "duplicate", "same content, other id: still one prompt"
    assert "different content" in (d.check(p("a", b"2")) or "")


BASE = {"prompts_uri": "s3://in-bucket/p.jsonl", "output_uri": "s3://out-bucket/ds", "servers": ["http://h:1"]}


def test_rerun_with_other_sampling_is_refused_with_the_difference() -> None:
    first = RunConfig.from_params(BASE)
    manifest = {"pinned": pinned_settings(first, '"etag"', 10)}
    second = RunConfig.from_params({**BASE, "max_tokens": 2048})
    with pytest.raises(PlanError) as info:
        check_pins(manifest, pinned_settings(second, '"etag"', 10), second)
    msg = str(info.value)
    assert "sampling.max_tokens: the dataset has 4096, this run asks for 2048" in msg
    assert "new output_uri" in msg and "accept_pin_changes" in msg
    allowed = RunConfig.from_params({**BASE, "max_tokens": 2048, "accept_pin_changes": True})
    assert check_pins(manifest, pinned_settings(allowed, '"etag"', 10), allowed)


def test_changed_input_is_never_accepted() -> None:
    cfg = RunConfig.from_params({**BASE, "accept_pin_changes": True})
    manifest = {"pinned": pinned_settings(cfg, '"etag1"', 10)}
    with pytest.raises(PlanError, match="input.etag"):
        check_pins(manifest, pinned_settings(cfg, '"etag2"', 10), cfg)
