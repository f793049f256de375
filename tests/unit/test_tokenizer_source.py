"""The tokenizer resolver: local folder, S3 (moto server over HTTP), a Hugging Face id from a hub cache built
here (the layout huggingface_hub writes: models--org--name/refs/main → snapshots/<commit>/), and the clear
failures (wrong id, missing file, missing or broken chat template)."""

from __future__ import annotations

import json
import socket
from pathlib import Path
from typing import Any

import pytest

from dflash_pipeline.dataset.tokenizer_source import (
    TokenizerError,
    check_tokenizer,
    check_tokenizer_spec,
    fetch_tokenizer,
    hf_repo_of,
    store_getter,
)
from dflash_pipeline.dev.hub_cache import fill_hub_cache
from dflash_pipeline.dev.sim.tokenizer import build_sim_tokenizer

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def _no_s3(bucket: str, key: str) -> Any:
    raise AssertionError("must not touch S3")


def hub_cache(root: Path, repo: str, source: Path, commit: str = COMMIT) -> Path:
    """A hub cache holding `source`'s tokenizer files as `repo` at `commit` (main points at it)."""
    fill_hub_cache(root, repo, source, commit)
    return root


@pytest.fixture
def tiny(tmp_path: Path) -> Path:
    return build_sim_tokenizer(tmp_path / "tiny")


@pytest.fixture
def offline_hub(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = hub_cache(tmp_path / "hub", "tiny-org/tiny-chat", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.chdir(tmp_path)  # no local folder named tiny-org/...
    return cache


def test_spec_kinds(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert hf_repo_of("Qwen/Qwen3-8B") == ("Qwen/Qwen3-8B", None)
    assert hf_repo_of(f"Qwen/Qwen3-8B@{COMMIT}") == ("Qwen/Qwen3-8B", COMMIT)
    for local in (str(tiny), "./a/b", "a/tokenizer.json", "s3://b/k", "justaname"):
        assert hf_repo_of(local) is None, local
    (tmp_path / "org" / "model").mkdir(parents=True)
    assert hf_repo_of("org/model") is None  # an existing local path is the local path


def test_local_folder_is_loaded_and_its_template_rendered(tiny: Path) -> None:
    rec = check_tokenizer(str(tiny), _no_s3, tiny.parent / "work")
    assert rec["kind"] == "local" and rec["revision"] is None and rec["template_source"] == "tokenizer_config.json"
    assert len(rec["tokenizer_json_sha256"]) == 64 and len(rec["chat_template_sha256"]) == 64
    assert rec["sample_tokens"]["thinking"] > 0 and rec["sample_tokens"]["no_thinking"] > 0


def test_missing_template_fails_clearly(tmp_path: Path) -> None:
    bare = build_sim_tokenizer(tmp_path / "bare", chat_template=None)
    with pytest.raises(TokenizerError, match=r"no chat template \(local: looked for chat_template.jinja and 'chat_template' in tokenizer_config.json"):
        check_tokenizer(str(bare), _no_s3, tmp_path / "work")


def test_template_that_does_not_render_fails_with_the_mode(tmp_path: Path) -> None:
    tok = build_sim_tokenizer(tmp_path / "t", chat_template=(
        "{% if not enable_thinking %}{{ raise_exception('thinking only') }}{% endif %}"
        "{% for m in messages %}{{ m['content'] }}{% endfor %}"))
    with pytest.raises(TokenizerError, match=r"does not render a sample conversation with enable_thinking=False: "
                                          r"TemplateError: thinking only"):
        check_tokenizer(str(tok), _no_s3, tmp_path / "work")
    drops = build_sim_tokenizer(tmp_path / "d", chat_template="{{ messages[-1]['content'] }}")
    with pytest.raises(TokenizerError, match="dropped the system message"):
        check_tokenizer(str(drops), _no_s3, tmp_path / "work2")


def test_missing_local_file_names_what_was_tried(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer '/nope/tok': /nope/tok/tokenizer.json does not exist|"
                                          r"/nope/tok does not exist"):
        check_tokenizer("/nope/tok", _no_s3, tmp_path)


def test_hugging_face_id_from_the_hub_cache_offline(offline_hub: Path, tiny: Path, tmp_path: Path) -> None:
    rec = check_tokenizer("tiny-org/tiny-chat", _no_s3, tmp_path / "work")
    local = check_tokenizer(str(tiny), _no_s3, tmp_path / "work2")
    assert rec["kind"] == "huggingface" and rec["revision"] == COMMIT and rec["source"] == "tiny-org/tiny-chat"
    assert rec["tokenizer_json_sha256"] == local["tokenizer_json_sha256"]
    assert rec["chat_template_sha256"] == local["chat_template_sha256"]
    pinned = fetch_tokenizer(f"tiny-org/tiny-chat@{COMMIT}", _no_s3, tmp_path)
    assert pinned.revision == COMMIT and pinned.tokenizer_json.parent.name == COMMIT


def test_wrong_hugging_face_id_fails_clearly_offline(offline_hub: Path, tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match=r"tokenizer 'tiny-org/no-such-model': tokenizer.json of 'tiny-org/no-such-model' "
                                          rf"is not in the hub cache {offline_hub} only \(HF_HUB_OFFLINE is set\)"):
        check_tokenizer("tiny-org/no-such-model", _no_s3, tmp_path)
    with pytest.raises(TokenizerError, match=r"is not in the hub cache"):
        check_tokenizer("tiny-org/tiny-chat@ffffffffffffffffffffffffffffffffffffffff", _no_s3, tmp_path)


def test_hugging_face_id_when_the_hub_is_unreachable(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Not offline, the hub's endpoint a closed port: a cached id still resolves (huggingface_hub falls back to
    its cache), an uncached one fails naming the endpoint tried."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the socket is
    cache = hub_cache(tmp_path / "hub", "tiny-org/tiny-chat", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.chdir(tmp_path)
    assert check_tokenizer("tiny-org/tiny-chat", _no_s3, tmp_path / "w")["revision"] == COMMIT
    with pytest.raises(TokenizerError, match=rf"tiny-org/other.*http://127.0.0.1:{port}"):
        check_tokenizer("tiny-org/other", _no_s3, tmp_path / "w2")


def test_s3_prefix_and_file_through_moto(s3_client: Any, bucket: str, tiny: Path, tmp_path: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        s3_client.put_object(Bucket=bucket, Key=f"models/tiny/{name}", Body=(tiny / name).read_bytes())
    etag = s3_client.head_object(Bucket=bucket, Key="models/tiny/tokenizer.json")["ETag"].strip('"')
    for spec in (f"s3://{bucket}/models/tiny", f"s3://{bucket}/models/tiny/tokenizer.json"):
        rec = check_tokenizer_spec(spec, s3_client)
        assert (rec["kind"], rec["revision"], rec["template_source"]) == ("s3", etag, "tokenizer_config.json"), spec
    with pytest.raises(TokenizerError, match=rf"s3://{bucket}/models/none/tokenizer.json does not exist"):
        check_tokenizer_spec(f"s3://{bucket}/models/none", s3_client)
    with pytest.raises(TokenizerError, match=r"cannot read s3://no-such-bucket-dflash/m/tokenizer.json"):
        check_tokenizer_spec("s3://no-such-bucket-dflash/m", s3_client)
    # only tokenizer.json on S3: no template, refused
    s3_client.put_object(Bucket=bucket, Key="bare/tokenizer.json", Body=(tiny / "tokenizer.json").read_bytes())
    with pytest.raises(TokenizerError, match=r"no chat template \(s3"):
        check_tokenizer(f"s3://{bucket}/bare", store_getter(s3_client), tmp_path / "w")


def test_recount_loads_a_hugging_face_id(offline_hub: Path) -> None:
    """Validation's loader takes the same specs."""
    from dflash_pipeline.steps.validate.tokencount import load_recounter

    rec = load_recounter("tiny-org/tiny-chat", _no_s3, enable_thinking=True)
    assert rec.template_source == "tokenizer_config.json" and rec.files.kind == "huggingface"
    assert json.loads(rec.files.tokenizer_json.read_text())


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def unreachable_hub(tmp_path: Path, tiny: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A worker whose hub endpoint refuses connections and HF_HUB_OFFLINE is not set (issue 41)."""
    cache = hub_cache(tmp_path / "hub", "tiny-org/tiny-chat", tiny)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    monkeypatch.chdir(tmp_path)
    return cache


def test_an_unreachable_hub_fails_an_uncached_id_at_once_with_one_message(
        unreachable_hub: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Issue 41: 33 s of huggingface_hub retries and 20 duplicated error lines before the real message."""
    with pytest.raises(TokenizerError, match=r"is unreachable .* and 'tiny-org/not-there' is not in the hub cache"):
        fetch_tokenizer("tiny-org/not-there", _no_s3, tmp_path / "work")
    retries = [r for r in caplog.records if "Retrying" in r.getMessage() or "thrown while requesting" in r.getMessage()]
    assert not retries, [r.getMessage() for r in retries]


def test_an_unreachable_hub_still_serves_a_cached_id(unreachable_hub: Path, tmp_path: Path) -> None:
    files = fetch_tokenizer("tiny-org/tiny-chat", _no_s3, tmp_path / "work")
    assert files.kind == "huggingface" and files.revision == COMMIT
