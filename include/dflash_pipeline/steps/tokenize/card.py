"""The dataset card: ``README.md`` at the dataset root, read by people and by Hugging Face `datasets`.

Why: without a card, ``datasets.load_dataset`` on our output needs guessing, and a trainer cannot tell what
the rows are (which model, which sampling, what was dropped, which tokenizer). The YAML front matter
declares one `datasets` config per file kind (``configs`` with ``data_files``) and the Parquet features
(``dataset_info``), so ``load_dataset("<root>", "parquet")`` loads with the declared features. A pure
function of the tokenize report, the pinned settings and the manifest: the same inputs give the same text.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from dflash_pipeline.steps.tokenize.gates import card_lines
from dflash_pipeline.steps.tokenize.profiles import HF_FEATURES, PROFILES, profile_globs

# config name → (profile, file kind, what it is for)
_CONFIGS: tuple[tuple[str, str, str, str], ...] = (
    ("parquet", "parquet", "rows", "every column of the training rows; `datasets`, NeMo-style loaders, analysis"),
    ("specforge", "specforge", "tokens", "SpecForge `data.prompts_path` (pre-tokenized `input_ids` + `loss_mask`)"),
    ("specforge_conversations", "specforge", "conversations",
     "SpecForge `data.train_data_path` (re-rendered by its chat template; `data.train_only_last_turn: true`)"),
    ("speculators", "speculators", "tokens", "vLLM speculators `prepare-data --data` (speculator-format rows)"),
)


def _yaml_features() -> list[dict[str, str]]:
    out = []
    for name, feat in HF_FEATURES.items():
        if feat["_type"] == "List":
            out.append({"name": name, "list": feat["feature"]["dtype"]})
        else:
            out.append({"name": name, "dtype": feat["dtype"]})
    return out


def _in_dir(path: str, tokenized_dir: str) -> str:
    """A path under tokenized/ moved to the tokenization's folder (tokenized/<name>/ for a named one)."""
    return tokenized_dir + path[len("tokenized"):] if path.startswith("tokenized/") else path


def front_matter(profiles: Sequence[str], tokenized_dir: str = "tokenized") -> dict[str, Any]:
    """The card's YAML header: `datasets` configs (``data_files``) and the Parquet features.

    `datasets` 5.1 picks one builder for a whole folder (``load_dataset("<root>", "specforge")`` next to
    Parquet files reads the JSONL as Parquet and fails), so the configs declared are those of one format:
    the ``parquet`` config when that profile is written, else the JSONL ones. The JSONL files always load
    with ``load_dataset("json", data_files=...)``."""
    configs = []
    parquet = "parquet" in profiles
    for name, profile, kind, _ in _CONFIGS:
        if profile in profiles and (profile == "parquet") == parquet:
            configs.append({"config_name": name, "data_files": [
                {"split": "train", "path": _in_dir(profile_globs(profile)[kind], tokenized_dir)}]})
    if configs:
        configs[0]["default"] = True
    meta: dict[str, Any] = {"configs": configs, "tags": ["speculative-decoding", "dflash", "eagle", "drafter-training"]}
    if "parquet" in profiles:
        meta["dataset_info"] = [{"config_name": "parquet", "features": _yaml_features()}]
    return meta


def _fmt(n: Any) -> str:
    return f"{n:,}" if isinstance(n, int) and not isinstance(n, bool) else str(n)


def heldout_lines(split: Mapping[str, Any] | None) -> list[str]:
    """The card's section on the held-out split (manifest["heldout"] plus tokenize's own heldout_uri)."""
    lines = ["## Held-out split", ""]
    if not split:
        return lines + ["None: every planned prompt is in the training rows. Give `heldout_fraction` (or "
                        "`heldout_uri`) to a new dataset's `dflash_generate` run to keep prompts out for the eval.", ""]
    key = split.get("uri") or split.get("key")
    lines += [
        "Conversations held out by id, never generated here and refused by tokenize (every sample and turn of "
        "an id goes the same way): an id is held out when sha256(`salt:id`) as a fraction of 2^64 is below "
        "the fraction, or when a held-out file names it.", "",
        "| what | value |", "|---|---|",
        f"| fraction | {split.get('fraction', 0.0)} |",
        f"| salt | `{split.get('salt', 'n/a')}` |",
        f"| held-out prompts | {_fmt(split.get('count', 0))} in `{key or 'n/a'}` (the eval's prompts_uri) |",
        f"| ids sha256 | `{split.get('ids_sha256', 'n/a')}` |",
        f"| named by plan's heldout_uri | `{split.get('heldout_uri') or 'none'}` |",
        f"| refused too at tokenize (heldout_uri) | `{split.get('tokenize_heldout_uri') or 'none'}` |", "",
    ]
    return lines


def tokenization_lines(current: str, tokenizations: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """The card's table of every tokenization of the dataset (name, folder, what differs), this card's marked."""
    lines = ["## Tokenizations", "",
             f"This card's configs and paths are tokenization `{current}`. Every tokenization of this dataset, each "
             "in its own folder with its `settings.json` and `report.md`:", "",
             "| name | folder | answers | tokenizer | max_length | train_turns | loss_on_reasoning | profiles | |",
             "|---|---|---|---|---:|---|---|---|---|"]
    for name, doc in sorted(tokenizations.items()):
        folder = doc.get("tokenized_dir") or ("tokenized" if name == "default" else f"tokenized/{name}")
        answers = doc.get("answers", "regenerated")
        defect = doc.get("defect") or {}
        if defect:
            answers += f", planted defect `{defect.get('name')}` (from `{defect.get('source_tokenization')}`)"
        lines.append(f"| `{name}` | `{folder}/` | {answers} | `{doc.get('tokenizer', 'n/a')}` "
                     f"| {_fmt(doc.get('max_length', 'n/a'))} "
                     f"| {doc.get('train_turns', 'n/a')} | {doc.get('loss_on_reasoning', 'n/a')} | "
                     f"{', '.join(doc.get('profiles') or [])} | {'this card' if name == current else ''} |")
    return lines + [""]


def dataset_card(report: Mapping[str, Any], settings: Mapping[str, Any], manifest: Mapping[str, Any],
                 tokenizations: Mapping[str, Mapping[str, Any]] | None = None) -> str:
    """README.md text for the dataset root.

    `report` is the tokenize report (``rows_in``, ``rows_out``, ``dropped_by_reason``, ``tokens``,
    ``loss_tokens``, ``truncated_to_max_length`` and, per profile, ``profiles`` → {name: {rows, ...}} with
    ``specforge_conversations`` → {rows, skipped}); `settings` the pinned tokenize settings (``profiles``,
    ``max_length``, ``min_loss_tokens``, ``tokenizer``, ``enable_thinking``, ``provenance``,
    ``specforge_template``); `manifest` the dataset's manifest.json. Missing keys print as "n/a"."""
    profiles = [p for p in PROFILES if p in (settings.get("profiles") or PROFILES)]
    prov = settings.get("provenance") or {}
    tok = prov.get("tokenizer") or {}
    gen = prov.get("generation") or {}
    sampling = gen.get("sampling") or (manifest.get("pinned") or {}).get("sampling") or {}
    model = gen.get("model") or manifest.get("model_resolved") or "n/a"
    engines = ", ".join(f"{e['engine']} {e['version']}" for e in gen.get("engines") or []) or "n/a"
    max_length = settings.get("max_length", "n/a")
    min_loss = settings.get("min_loss_tokens", "n/a")
    template = settings.get("specforge_template") or "qwen3.5"
    thinking = settings.get("enable_thinking", sampling.get("enable_thinking"))
    tokenized_dir = str(settings.get("tokenized_dir") or "tokenized")
    current = str(settings.get("tokenization") or "default")
    head = yaml.safe_dump(front_matter(profiles, tokenized_dir), sort_keys=False, allow_unicode=True)

    dropped = report.get("dropped_by_reason") or {}
    lines = [
        "---", head.rstrip("\n"), "---", "",
        *_intro(settings, model),
        "## Generation", "",
        "| what | value |", "|---|---|",
        f"| model | `{model}` |",
        f"| engines | {engines} |",
        f"| sampling | temperature {sampling.get('temperature', 'n/a')}, top_p {sampling.get('top_p', 'n/a')}, "
        f"max_tokens {_fmt(sampling.get('max_tokens', 'n/a'))}, seed {sampling.get('seed', 'n/a')} |",
        f"| thinking | {thinking} |",
        f"| regenerate | {gen.get('regenerate', 'n/a')}, {gen.get('samples_per_prompt', 'n/a')} sample(s) per prompt |",
        f"| prompts | {_fmt(gen.get('prompts', 'n/a'))} from {_sources(gen.get('prompts_uri'))} |", "",
        "## Rows", "",
        "| figure | value |", "|---|---:|",
        f"| completions rows in | {_fmt(report.get('rows_in', 'n/a'))} |",
        f"| training rows kept | {_fmt(report.get('rows_out', 'n/a'))} |",
        *(f"| dropped: {k} | {_fmt(v)} |" for k, v in sorted(dropped.items())),
        f"| rows cut at max_length {_fmt(max_length)} (kept) | {_fmt(report.get('truncated_to_max_length', 'n/a'))} |",
        f"| tokens / loss tokens | {_fmt(report.get('tokens', 'n/a'))} / {_fmt(report.get('loss_tokens', 'n/a'))} |",
        "",
        f"Kept rows are DFlash-ready: at most {_fmt(max_length)} tokens (longer ones cut, as SpecForge and "
        f"speculators cut them), at least {_fmt(min_loss)} loss tokens, two of them adjacent (DFlash anchors a "
        "block on a trained token followed by a trained token).", "",
    ]
    lines += card_lines(report)
    conv = ((report.get("profiles") or {}).get("specforge") or {}).get("specforge_conversations") or {}
    if "specforge" in profiles:
        skipped = conv.get("skipped") or {}
        lines += [
            f"SpecForge conversations file: {_fmt(conv.get('rows', 'n/a'))} rows, "
            f"{_fmt(conv.get('without_system_message', 'n/a'))} of them without a system message (SpecForge "
            "templates other than `qwen3.5` add their default system prompt to those); left out (still in every "
            "token file): " + (", ".join(f"{k} {_fmt(v)}" for k, v in sorted(skipped.items())) or "none") + ".", "",
        ]
    lines += heldout_lines(report.get("heldout") or manifest.get("heldout"))
    lines += [
        "## Files and columns", "",
        "| config | files | for |", "|---|---|---|",
        *(f"| `{name}` | `{profile_globs(profile)[kind]}` | {what} |"
          for name, profile, kind, what in _CONFIGS if profile in profiles),
        "",
        "Parquet columns: `id`, `sample` (prompt and sample index), `turn` (0-based assistant turn), `key` "
        "(unique row key), `input_ids` (list<int32>), `loss_mask` (list<int8>, same length), `num_tokens`, "
        "`num_loss_tokens`, `truncated_to_max_length`, `finish_reason` (`stop` | `length`), `ids_source` "
        "(`engine`: the engine's own ids; `retokenized`: re-encoded text, checked), `ids_canonical` (the generated "
        "ids are the canonical encoding of their text, so a trainer re-tokenizing the text gets them back), "
        "`source`, `domain` (the input row's, null if none), `metadata` (the input row's metadata object and "
        "extra keys, JSON-encoded; null if none), `thinking` (the thinking mode the row was generated with), "
        "`sampling` (the sampling fields its request carried, JSON; null on rows from before the column). "
        "The JSONL files carry the same five (`\"\"` for none); speculators' inside its `metadata`.", "",
        "## Train a drafter on it", "",
        "```python",
        "from datasets import load_dataset",
        'rows = load_dataset("<this folder>", "parquet", split="train")  # the Parquet profile, features declared',
        'specforge = load_dataset("json", data_files="<this folder>/tokenized/specforge/part-*.jsonl", split="train")',
        "```", "",
    ]
    if "specforge" in profiles:
        lines += [
            "**SpecForge 0.2.0 (DFlash / EAGLE3)**, pre-tokenized (exact ids): concatenate the part files "
            "(`data.prompts_path` reads one file) and point the run config at it:", "",
            "```bash",
            "cat tokenized/specforge/part-*.jsonl > train.jsonl",
            "```", "",
            "```yaml",
            "data:",
            "  prompts_path: ./train.jsonl",
            f"  max_length: {max_length}",
            "training:",
            "  strategy: dflash",
            "```", "",
            "Or let SpecForge render the conversations (`cat tokenized/specforge-conversations/part-*.jsonl > "
            f"conversations.jsonl`; `data.train_data_path`, `data.chat_template: {template}`, "
            f"`data.train_only_last_turn: true`, `data.max_length: {max_length}`). The rows are already one "
            "generation event per assistant turn: do not run `expand_reasoning_conversations.py` on them.", "",
        ]
    if "speculators" in profiles:
        lines += [
            "**vLLM speculators 0.9.0**: `speculators prepare-data --model <target model> --data "
            f"tokenized/speculators/ --output ./prepared --seq-length {max_length}` keeps our ids and masks "
            "(no render endpoint needed), then `speculators train --data-path ./prepared ...`.", "",
        ]
    lines += [
        "## Provenance", "",
        "| what | value |", "|---|---|",
        f"| tokenizer | `{tok.get('source') or settings.get('tokenizer', 'n/a')}` |",
        f"| tokenizer.json sha256 | `{tok.get('tokenizer_json_sha256', 'n/a')}` |",
        f"| chat template sha256 | `{tok.get('chat_template_sha256', 'n/a')}` (SpecForge's cache key hash: "
        f"`{tok.get('specforge_template_hash', 'n/a')}`) |",
        f"| plan | `{gen.get('plan_id', manifest.get('plan_id', 'n/a'))}` |",
        "",
    ]
    body = lines[3:]  # the paths of the text, under this tokenization's folder (the header is already)
    if tokenized_dir != "tokenized":
        body = [line.replace("tokenized/", f"{tokenized_dir}/") for line in body]
    if tokenizations and (len(tokenizations) > 1 or current != "default"):
        body += tokenization_lines(current, tokenizations)
    return "\n".join(lines[:3] + body)


def _intro(settings: Mapping[str, Any], model: str) -> list[str]:
    """The card's title and first paragraph: what the rows train (regenerated or original answers, a planted defect)."""
    if settings.get("answers") == "original":
        lines = [
            f"# Drafter training data: the prompts' original answers, not `{model}`'s",
            "",
            "**answers: original.** The input's own answers (`original_messages`), not the target model's: one training "
            "row per original assistant answer at the place the regeneration answers (`dflash_tokenize` with `answers: "
            "original`), its context the original conversation before it, rendered with the model's chat template in "
            "the row's thinking mode (thinking on: an answer without reasoning gets the template's empty think block, "
            "trained, as SpecForge trains raw data; thinking off: the answer's reasoning is left out). `loss_mask` is 1 "
            "on the answer's tokens. **Not token-exact**: no engine ids, the text is encoded here (`ids_source` "
            "`original`). The baseline an on-policy dataset is measured against.", "",
        ]
    else:
        lines = [
            f"# Drafter training data regenerated from `{model}`", "",
            "Generated by dflash-pipeline: every prompt answered again by the target model on a fleet of inference "
            "servers (`dflash_generate`), validated, then tokenized into one training row per generated assistant "
            "turn (`dflash_tokenize`): the turn's context exactly as the engine saw it, then the tokens it "
            "generated. `loss_mask` is 1 on generated tokens only.", "",
        ]
    defect = settings.get("defect") or {}
    if defect:
        lines[2:2] = [f"**PLANTED DEFECT `{defect.get('name')}`**: {defect.get('what')} Made by dev tooling "
                      f"(`dflash_pipeline.dev.data_defects`) from tokenization `{defect.get('source_tokenization')}` "
                      "for the data-sensitivity experiment: never train a drafter for use on it.", ""]
    return lines


def _sources(value: Any) -> str:
    """prompts_uri as given: one URI, or a list of URIs / {uri, weight, source} (docs/inputs.md)."""
    if value is None:
        return "`n/a`"
    items = value if isinstance(value, list) else [value]
    out = []
    for it in items:
        if isinstance(it, dict):
            extra = ", ".join(f"{k} {it[k]}" for k in ("weight", "source") if it.get(k) is not None)
            out.append(f"`{it.get('uri')}`" + (f" ({extra})" if extra else ""))
        else:
            out.append(f"`{it}`")
    return ", ".join(out)
