"""Find the training tokenizer and check it before any GPU works: one resolver for every place that loads it.

Why: `tokenizer` is given once, at trigger time, and used hours later (validation's recount, tokenize).
A wrong id or a missing chat template must fail the run at planning, not at the end. A spec is one of:

* ``s3://bucket/path/tokenizer.json`` or an ``s3://bucket/prefix`` holding ``tokenizer.json`` (+
  ``tokenizer_config.json`` / ``chat_template.jinja``); the tokenizer file's ETag is recorded;
* a local ``tokenizer.json`` or a directory holding it (a model directory);
* a Hugging Face id, ``org/name`` or ``org/name@revision``, read through huggingface_hub's usual cache
  (``HF_HOME`` / ``HF_HUB_CACHE``), with ``local_files_only`` when ``HF_HUB_OFFLINE`` is set; the snapshot's
  commit sha is recorded. A spec that is an existing local path is always the local path.

`fetch_tokenizer` resolves a spec to local files (validation and tokenize load them from there);
`check_tokenizer` also loads the tokenizer and renders its chat template on a sample conversation, thinking
on and off, and returns the record plan writes into the manifest (`manifest["tokenizer"]`). Every failure is
a `TokenizerError` naming the spec, what was tried and what is missing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_pipeline.dataset.layout import UriError, parse_s3_uri

logger = logging.getLogger(__name__)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
JINJA_FILE = "chat_template.jinja"
OPTIONAL_FILES = (CONFIG_FILE, JINJA_FILE)

HF_ID_RE = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9_.\-]{0,95}/[A-Za-z0-9][A-Za-z0-9_.\-]{0,95})"
                      r"(?:@(?P<revision>[A-Za-z0-9_.\-/]{1,200}))?$")
"""A Hugging Face model id (``org/name``), optionally pinned to a revision (branch, tag or commit) after ``@``."""

SAMPLE_CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5", "reasoning_content": "2 plus 3 is 5."},
    {"role": "user", "content": "And 4 + 4?"},
]
"""What the check renders: a system turn, an answered turn with reasoning and an open user turn."""

class TokenizerError(ValueError):
    """The tokenizer cannot be found, read or used: retrying cannot fix it (callers turn it into their own
    configuration error)."""


S3Get = Callable[[str, str], "bytes | tuple[bytes, str | None] | None"]
"""`s3_get(bucket, key)`: the object's bytes (or (bytes, ETag)), None when absent."""


@dataclass
class TokenizerFiles:
    """Where a tokenizer came from and what was found next to it."""

    spec: str
    tokenizer_json: Path
    config: dict[str, Any] = field(default_factory=dict)
    chat_template: str | None = None
    template_source: str = "fallback"
    kind: str = "local"
    """'local', 's3' or 'huggingface'."""
    revision: str | None = None
    """Hugging Face: the snapshot's commit sha; S3: the tokenizer.json's ETag; local: None."""


def hf_repo_of(spec: str) -> tuple[str, str | None] | None:
    """(repo id, revision) when `spec` reads as a Hugging Face id and is not an existing local path."""
    if spec.startswith(("s3://", "/", ".", "~")) or Path(spec).expanduser().exists():
        return None
    m = HF_ID_RE.match(spec)
    if m is None or spec.endswith(".json"):
        return None
    return m.group("repo"), m.group("revision")


def _read_config(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise TokenizerError(f"tokenizer: cannot read {path.name}: {exc}") from exc
    return data if isinstance(data, dict) else {}


def _pick_template(config: dict[str, Any], jinja_file: Path | None) -> tuple[str | None, str]:
    if jinja_file is not None and jinja_file.is_file():
        return jinja_file.read_text(), JINJA_FILE
    tpl = config.get("chat_template")
    if isinstance(tpl, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default") or next(iter(named.values()), None)
    if isinstance(tpl, str) and tpl.strip():
        return tpl, CONFIG_FILE
    return None, "fallback"


def _local_files(spec: str) -> TokenizerFiles:
    p = Path(spec).expanduser()
    if p.is_dir():
        folder, tj = p, p / TOKENIZER_FILE
    else:
        folder, tj = p.parent, p
    if not tj.is_file():
        raise TokenizerError(f"tokenizer {spec!r}: {tj} does not exist (give a tokenizer.json, a model directory, "
                          "an s3:// URI or a Hugging Face id such as Qwen/Qwen3-8B)")
    cfg_path = folder / CONFIG_FILE
    config = _read_config(cfg_path) if cfg_path.is_file() else {}
    template, source = _pick_template(config, folder / JINJA_FILE)
    return TokenizerFiles(spec, tj, config, template, source)


def _s3_files(spec: str, s3_get: S3Get, workdir: Path) -> TokenizerFiles:
    try:
        uri = parse_s3_uri(spec, what="tokenizer")
    except UriError as exc:
        raise TokenizerError(str(exc)) from exc
    if uri.key.endswith(".json"):
        tj_key = uri.key
        prefix = uri.key.rsplit("/", 1)[0] if "/" in uri.key else ""
    else:
        prefix = uri.key
        tj_key = f"{prefix}/{TOKENIZER_FILE}"

    def key(name: str) -> str:
        return f"{prefix}/{name}" if prefix else name

    def get(k: str) -> tuple[bytes | None, str | None]:
        try:
            got = s3_get(uri.bucket, k)
        except TokenizerError:
            raise
        except Exception as exc:  # noqa: BLE001 - the store's errors: access denied, no such bucket, unreachable
            raise TokenizerError(f"tokenizer {spec!r}: cannot read s3://{uri.bucket}/{k}: {exc}") from exc
        if isinstance(got, tuple):
            return got[0], got[1]
        return got, None

    data, etag = get(tj_key)
    if data is None:
        raise TokenizerError(f"tokenizer {spec!r}: s3://{uri.bucket}/{tj_key} does not exist")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / TOKENIZER_FILE).write_bytes(data)
    for name in OPTIONAL_FILES:
        extra, _ = get(key(name))
        if extra is not None:
            (workdir / name).write_bytes(extra)
    files = _local_files(str(workdir))
    files.spec, files.kind, files.revision = spec, "s3", (etag or "").strip('"') or None
    return files


def hub_settings() -> dict[str, Any]:
    """The cache folder, offline flag and endpoint, read from the environment when called (huggingface_hub
    reads them once, at import; a task may set them later)."""
    env = os.environ
    cache = env.get("HF_HUB_CACHE") or (str(Path(env["HF_HOME"]) / "hub") if env.get("HF_HOME") else None)
    offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    return {"cache_dir": cache, "local_files_only": offline, "endpoint": env.get("HF_ENDPOINT") or None}


HUB_ENDPOINT = "https://huggingface.co"
HUB_PROBE_TIMEOUT_S = 3.0
"""One connection to the hub, before any download: huggingface_hub retries an unreachable hub with backoff
(about 25 s and a warning per try); a worker without the hub should use its cache or fail at once."""


def hub_unreachable(endpoint: str | None) -> str | None:
    """Why the hub cannot be reached (DNS, refused, timeout), or None when it answers at all."""
    import requests

    try:
        requests.head(endpoint or HUB_ENDPOINT, timeout=HUB_PROBE_TIMEOUT_S, allow_redirects=False)
    except requests.RequestException as exc:
        return f"{type(exc).__name__}: {str(exc)[:160]}"
    return None


def _hub_files(spec: str, repo: str, revision: str | None) -> TokenizerFiles:
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import (EntryNotFoundError, GatedRepoError, LocalEntryNotFoundError,
                                        RepositoryNotFoundError, RevisionNotFoundError)

    hub = hub_settings()
    down = None if hub["local_files_only"] else hub_unreachable(hub["endpoint"])
    if down is not None:  # a worker without the hub: the cache alone, and one message if the id is not there
        hub["local_files_only"] = True
    where = f"the hub cache {hub['cache_dir'] or '(huggingface_hub default)'}" + (
        " only (HF_HUB_OFFLINE is set)" if hub["local_files_only"] and down is None
        else "" if down is not None else f" and {hub['endpoint'] or 'huggingface.co'}")
    where += f"; read as a Hugging Face id because no local path {spec!r} exists"

    def download(name: str) -> str:
        return str(hf_hub_download(repo, name, revision=revision, cache_dir=hub["cache_dir"],
                                   local_files_only=hub["local_files_only"], endpoint=hub["endpoint"]))

    try:
        path = Path(download(TOKENIZER_FILE))
    except (RepositoryNotFoundError, GatedRepoError) as exc:
        raise TokenizerError(f"tokenizer {spec!r}: Hugging Face repository {repo!r} not found or not accessible "
                          f"(tried {where}): {type(exc).__name__}") from exc
    except RevisionNotFoundError as exc:
        raise TokenizerError(f"tokenizer {spec!r}: revision {revision!r} of {repo!r} not found (tried {where})") from exc
    except LocalEntryNotFoundError as exc:
        if down is not None:
            raise TokenizerError(f"tokenizer {spec!r}: the hub {hub['endpoint'] or HUB_ENDPOINT} is unreachable ({down}) "
                                 f"and {repo!r} is not in {where}; fill the cache (huggingface-cli download {repo} "
                                 f"{TOKENIZER_FILE} {CONFIG_FILE}), set HF_ENDPOINT to a mirror, or give a local "
                                 f"directory or an s3:// URI") from exc
        raise TokenizerError(f"tokenizer {spec!r}: {TOKENIZER_FILE} of {repo!r} is not in {where}; on a machine "
                          f"without the hub, fill the cache first (huggingface-cli download {repo} {TOKENIZER_FILE} "
                          f"{CONFIG_FILE}) or give a local directory or an s3:// URI") from exc
    except EntryNotFoundError as exc:
        raise TokenizerError(f"tokenizer {spec!r}: {repo!r} has no {TOKENIZER_FILE} (tried {where})") from exc
    except Exception as exc:  # noqa: BLE001 - HTTP errors, bad ids (HFValidationError), an unwritable cache
        raise TokenizerError(f"tokenizer {spec!r}: cannot load {TOKENIZER_FILE} of {repo!r} from {where}: "
                          f"{type(exc).__name__}: {exc}") from exc
    for name in OPTIONAL_FILES:
        try:
            download(name)
        except Exception as exc:  # noqa: BLE001 - optional file: absent in the repo or not cached
            logger.info("tokenizer %s: no %s (%s)", spec, name, type(exc).__name__)
    files = _local_files(str(path.parent))
    # the snapshot folder is named by its commit sha: .../models--org--name/snapshots/<sha>/tokenizer.json
    files.spec, files.kind, files.revision = spec, "huggingface", path.parent.name
    return files


def fetch_tokenizer(spec: str, s3_get: S3Get, workdir: Path) -> TokenizerFiles:
    """Resolve `spec` to local files: S3 objects are copied to `workdir`, hub files stay in the hub cache."""
    if not isinstance(spec, str) or not spec.strip():
        raise TokenizerError("tokenizer: empty spec")
    if spec.startswith("s3://"):
        return _s3_files(spec, s3_get, workdir)
    hf = hf_repo_of(spec)
    if hf is not None:
        return _hub_files(spec, *hf)
    return _local_files(spec)


def jinja_env() -> Any:
    """A sandboxed environment configured like the one Hugging Face renders chat templates with."""
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        from datetime import datetime

        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def _sha256(data: bytes | str) -> str:
    return hashlib.sha256(data.encode("utf-8") if isinstance(data, str) else data).hexdigest()


def render_sample(files: TokenizerFiles, enable_thinking: bool) -> str:
    """The sample conversation through the chat template with a generation prompt (as the engine renders a
    request); a template error is a TokenizerError naming the tokenizer and the thinking mode."""
    assert files.chat_template is not None
    special = {k: v if isinstance(v, str) else (v or {}).get("content", "") for k, v in files.config.items()
               if k in ("bos_token", "eos_token", "pad_token", "unk_token") and v}
    try:
        text = jinja_env().from_string(files.chat_template).render(
            messages=SAMPLE_CONVERSATION, add_generation_prompt=True, enable_thinking=enable_thinking, tools=None,
            **special)
    except Exception as exc:  # noqa: BLE001 - jinja's TemplateError, or a template that calls missing helpers
        raise TokenizerError(f"tokenizer {files.spec!r}: its chat template ({files.template_source}) does not render a "
                          f"sample conversation with enable_thinking={enable_thinking}: {type(exc).__name__}: {exc}") from exc
    for msg in SAMPLE_CONVERSATION:
        if msg["content"] not in text:
            raise TokenizerError(f"tokenizer {files.spec!r}: its chat template ({files.template_source}) dropped the "
                              f"{msg['role']} message {msg['content']!r} of the sample conversation "
                              f"(enable_thinking={enable_thinking})")
    return text


def store_getter(client: Any) -> S3Get:
    """`s3_get` over a boto3 client (retried like every other read), returning (bytes, ETag)."""
    from dflash_pipeline.dataset.store import Store, with_retries

    def get(bucket: str, key: str) -> tuple[bytes, str | None] | None:
        got = with_retries(lambda: Store(client, bucket).get(key), what=f"read tokenizer s3://{bucket}/{key}")
        return None if got is None else (got[0], got[1])

    return get


def check_tokenizer_spec(spec: str, client: Any) -> dict[str, Any]:
    """`check_tokenizer` with S3 read through `client` and a scratch folder removed afterwards."""
    import tempfile

    with tempfile.TemporaryDirectory(prefix="dflash-tokenizer-check-") as tmp:
        return check_tokenizer(spec, store_getter(client), Path(tmp))


def check_tokenizer(spec: str, s3_get: S3Get, workdir: Path) -> dict[str, Any]:
    """Resolve, load and render: the record plan keeps in the manifest. Raises TokenizerError (which source was
    tried, what is missing) for a tokenizer that cannot be found or read, or has no usable chat template."""
    from tokenizers import Tokenizer

    files = fetch_tokenizer(spec, s3_get, workdir)
    data = files.tokenizer_json.read_bytes()
    try:
        tok = Tokenizer.from_str(data.decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception on a bad file
        raise TokenizerError(f"tokenizer {spec!r}: {files.tokenizer_json} ({files.kind}) is not a tokenizers file: "
                          f"{exc}") from exc
    if files.chat_template is None:
        raise TokenizerError(f"tokenizer {spec!r}: no chat template ({files.kind}: looked for {JINJA_FILE} and "
                          f"'chat_template' in {CONFIG_FILE} next to {TOKENIZER_FILE}); the training rows must be "
                          "rendered as the engine rendered the requests: add the model's tokenizer_config.json")
    rendered = {mode: render_sample(files, mode) for mode in (True, False)}
    tokens = {mode: len(tok.encode(text, add_special_tokens=False).ids) for mode, text in rendered.items()}
    if not all(tokens.values()):
        raise TokenizerError(f"tokenizer {spec!r}: encodes the rendered sample to no tokens")
    record = {
        "source": spec,
        "kind": files.kind,
        "revision": files.revision,
        "tokenizer_json_sha256": _sha256(data),
        "chat_template_sha256": _sha256(files.chat_template),
        "template_source": files.template_source,
        "vocab_size": tok.get_vocab_size(),
        "sample_tokens": {"thinking": tokens[True], "no_thinking": tokens[False]},
    }
    logger.info("tokenizer %s checked: %s", spec, record)
    return record
