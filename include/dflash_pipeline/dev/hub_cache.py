"""A Hugging Face hub cache filled from a local tokenizer folder, for tests and demos without the hub.

The layout is the one huggingface_hub writes and reads (`models--org--name/refs/main` holding the commit,
`snapshots/<commit>/<file>`), so `hf_hub_download(..., local_files_only=True)` resolves an id from it exactly
as from a cache filled by `huggingface-cli download`.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def fill_hub_cache(cache: Path, repo_id: str, source: Path, commit: str | None = None) -> str:
    """Put `source`'s tokenizer files in `cache` as `repo_id` at `commit` (default: a sha1 of the files), with
    `main` pointing at it. Returns the commit."""
    present = [name for name in FILES if (source / name).is_file()]
    if commit is None:
        digest = hashlib.sha1()
        for name in present:
            digest.update((source / name).read_bytes())
        commit = digest.hexdigest()
    folder = cache / ("models--" + repo_id.replace("/", "--"))
    snap = folder / "snapshots" / commit
    snap.mkdir(parents=True, exist_ok=True)
    for name in present:
        shutil.copyfile(source / name, snap / name)
    (folder / "refs").mkdir(exist_ok=True)
    (folder / "refs" / "main").write_text(commit)
    return commit
