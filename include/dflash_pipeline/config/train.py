"""dflash_train's params: their JSON schemas (the DAG's Params) and the checked TrainConfig.

One run trains one drafter per (dataset, tokenization) on the tokenization's SpecForge files
(`tokenized[/<name>]/specforge/part-*.jsonl`), with the field's trainer: locally (a subprocess in the trainers'
venv, CPU) or on a Kubernetes cluster (the cncf.kubernetes provider's KubernetesPodOperator, GPUs).
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import Any

from dflash_pipeline.config.run import SECTION_DATA, SECTION_RUN, ConfigError, _check_schema
from dflash_pipeline.dataset.layout import (
    DEFAULT_TOKENIZATION,
    TOKENIZATION_NAME_RE,
    UriError,
    parse_s3_uri,
)

SECTION_TRAIN = "Train"
SECTION_KUBERNETES = "Kubernetes"
BACKENDS = ("local", "kubernetes")
DRAFTER_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.\-]{0,62}$")
DEFAULT_TRAINERS_PYTHON = ".venv-trainers/bin/python"
"""The trainers' venv (relative to the repo, or the DFLASH_TRAINERS_PYTHON environment variable)."""
DEFAULT_KUBERNETES_COMMAND: tuple[str, ...] = (
    "bash", "-c",
    "set -euo pipefail; mkdir -p /data/parts /out; "
    "aws s3 cp --recursive {conversations_prefix} /data/parts/; cat /data/parts/part-*.jsonl > /data/train.jsonl; "
    "aws s3 cp --recursive {drafter_prefix}checkpoints/ /out/ || true; "
    "torchrun --standalone --nproc_per_node {gpus} scripts/train_dflash.py "
    "--target-model-path {target_model} --train-data-path /data/train.jsonl --chat-template {chat_template} "
    "--output-dir /out --resume --num-epochs {num_epochs} --batch-size {batch_size} "
    "--learning-rate {learning_rate} --max-length {max_length} --block-size {block_size} "
    "--num-draft-layers {num_draft_layers} --save-interval {save_every} --seed {seed}; "
    "aws s3 cp --recursive /out/ {drafter_prefix}checkpoints/",
)
"""The pod's command: fetch the SpecForge conversations files, run SpecForge's own `scripts/train_dflash.py` (its
flags as of SpecForge's main branch, Dec 2026: it has epochs, not a step count, so {num_epochs} is the epochs
that cover `steps`), resume from the checkpoints a killed pod left, copy them up.
Placeholders in braces are filled from the run (steps.train.kubernetes.COMMAND_FIELDS); the flags are the
user's to adapt to their SpecForge version (the param is the interface)."""

TRAIN_PARAM_SCHEMAS: dict[str, dict[str, Any]] = {
    "dataset_uri": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "Manual runs: s3://bucket/prefix of the tokenized dataset root to train on. Runs queued by "
        "the dflash_tokenized asset take the datasets (and their tokenization) from the event and ignore this.",
        "section": SECTION_DATA,
    },
    "tokenization": {
        "type": "string",
        "default": DEFAULT_TOKENIZATION,
        "pattern": "^[a-z0-9][a-z0-9_-]{0,62}$",
        "description": "Manual runs: which tokenization of the dataset to train on ('default' = the files directly "
        "under tokenized/, else tokenized/<name>/). It must be complete (its report.json says so) and carry the "
        "'specforge' format.",
        "section": SECTION_DATA,
    },
    "drafter_name": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^[a-z0-9][a-z0-9_.-]{0,62}$",
        "description": "The drafter's name: it lands under <drafters_root>/<name>/. The same name with the same "
        "settings resumes (or does nothing once its card exists); with other settings it is refused. Null = "
        "<tokenization>-<8 hex of the settings hash>.",
        "section": SECTION_TRAIN,
    },
    "drafters_root": {
        "type": ["null", "string"],
        "default": None,
        "pattern": "^s3://[^/]+/.+",
        "description": "s3://bucket/prefix under which drafters are written, one folder per name. Null = "
        "<dataset root>/drafters.",
        "section": SECTION_DATA,
    },
    "target_model": {
        "type": ["null", "string"],
        "default": None,
        "minLength": 1,
        "description": "The target model the drafter learns to follow: a Hugging Face id (kubernetes backend), a local "
        "model directory, or an s3:// prefix holding it (the local backend copies it to the work dir; it refuses a "
        "hub id). Null = the model recorded in the dataset's manifest (what generated the data).",
        "section": SECTION_TRAIN,
    },
    "backend": {
        "type": "string",
        "enum": list(BACKENDS),
        "default": "local",
        "description": "'local': the trainer runs as a subprocess of the worker in the trainers' venv (CPU; tiny "
        "models, CI). 'kubernetes': a pod per drafter through the cncf.kubernetes provider's "
        "KubernetesPodOperator (the kubernetes_* params; GPUs).",
        "section": SECTION_RUN,
    },
    "steps": {"type": "integer", "default": 1000, "minimum": 1, "maximum": 10_000_000,
              "description": "Optimizer steps.", "section": SECTION_TRAIN},
    "seed": {"type": "integer", "default": 0, "minimum": 0, "maximum": 2**31 - 1,
             "description": "Seed of the drafter's initialization and of the data order.", "section": SECTION_TRAIN},
    "learning_rate": {"type": "number", "default": 6e-4, "exclusiveMinimum": 0, "maximum": 1,
                      "description": "Peak learning rate.", "section": SECTION_TRAIN},
    "batch_size": {"type": "integer", "default": 1, "minimum": 1, "maximum": 4096,
                   "description": "Training rows per step (per GPU on kubernetes).", "section": SECTION_TRAIN},
    "max_length": {"type": "integer", "default": 4096, "minimum": 16, "maximum": 1048576,
                   "description": "Tokens per training row at most (rows are cut here). The tokenization's own "
                   "max_length already cut them; a larger value here changes nothing.", "section": SECTION_TRAIN},
    "block_size": {"type": "integer", "default": 16, "minimum": 2, "maximum": 64,
                   "description": "DFlash block size: tokens drafted per block (SpecForge's default 16).",
                   "section": SECTION_TRAIN},
    "num_draft_layers": {"type": "integer", "default": 1, "minimum": 1, "maximum": 64,
                         "description": "Transformer layers of the drafter.", "section": SECTION_TRAIN},
    "save_every": {"type": "integer", "default": 500, "minimum": 1, "maximum": 10_000_000,
                   "description": "Steps between checkpoints of the trainer's state (what a killed run resumes "
                   "from). Not part of the drafter's settings.", "section": SECTION_TRAIN},
    "trainers_python": {
        "type": ["null", "string"],
        "default": None,
        "description": "Local backend: the trainers' venv python. Null = $DFLASH_TRAINERS_PYTHON, else "
        f"{DEFAULT_TRAINERS_PYTHON} under the repo.",
        "section": SECTION_RUN,
    },
    "trainer_entry": {
        "type": ["null", "string"],
        "default": None,
        "description": "Local backend: the trainer script run with `--config cfg.json`. Null = "
        "include/dflash_pipeline/steps/train/specforge_entry.py (SpecForge's DFlash code on CPU).",
        "section": SECTION_RUN,
    },
    "work_dir": {
        "type": ["null", "string"],
        "default": None,
        "description": "Local backend: where the files are downloaded and the trainer writes (a fixed folder per "
        "drafter under it, so a rerun on the same worker resumes). Null = $DFLASH_TRAIN_WORK_DIR, else the system "
        "temp dir + dflash-train.",
        "section": SECTION_RUN,
    },
    "kubernetes_image": {
        "type": ["null", "string"],
        "default": None,
        "description": "Kubernetes backend: the trainer image (SpecForge installed, its scripts/ in the working "
        "directory, the aws CLI). Required with backend 'kubernetes'.",
        "section": SECTION_KUBERNETES,
    },
    "kubernetes_namespace": {"type": "string", "default": "default", "pattern": "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$",
                             "description": "Kubernetes backend: the pods' namespace.", "section": SECTION_KUBERNETES},
    "kubernetes_gpus": {"type": "integer", "default": 8, "minimum": 1, "maximum": 64,
                        "description": "Kubernetes backend: GPUs of the pod (nvidia.com/gpu request and limit); "
                        "torchrun starts one process per GPU.", "section": SECTION_KUBERNETES},
    "kubernetes_node_selector": {
        "type": "object",
        "default": {},
        "additionalProperties": {"type": "string"},
        "description": "Kubernetes backend: node labels the pod must run on, e.g. "
        "{\"nvidia.com/gpu.product\": \"NVIDIA-H100-80GB-HBM3\"}.",
        "section": SECTION_KUBERNETES,
    },
    "kubernetes_service_account": {
        "type": ["null", "string"],
        "default": None,
        "description": "Kubernetes backend: the pod's service account (the one allowed to read the dataset and "
        "write the drafters root, e.g. through IRSA). Null = the namespace's default.",
        "section": SECTION_KUBERNETES,
    },
    "kubernetes_command": {
        "type": "array",
        "default": list(DEFAULT_KUBERNETES_COMMAND),
        "minItems": 1,
        "items": {"type": "string"},
        "description": "Kubernetes backend: the container's command; {conversations_prefix}, {tokens_prefix}, "
        "{drafter_prefix}, {target_model}, {chat_template}, {gpus}, {num_epochs}, {steps}, {seed}, {learning_rate}, "
        "{batch_size}, {max_length}, {block_size}, {num_draft_layers}, {save_every} are filled in (an unknown "
        "placeholder is refused before any pod starts). Default: SpecForge's scripts/train_dflash.py under "
        "torchrun on the tokenization's specforge-conversations files, checkpoints copied with the aws CLI.",
        "section": SECTION_KUBERNETES,
    },
    "aws_conn_id": {"type": "string", "default": "aws_default", "minLength": 1,
                    "description": "Airflow connection id (type aws) of the datasets' and drafters' S3 store.",
                    "section": SECTION_DATA},
}

TRAIN_ESSENTIAL_PARAMS: tuple[str, ...] = ("dataset_uri", "tokenization", "drafter_name", "drafters_root",
                                           "target_model", "backend", "steps")
HYPERPARAMETERS = ("steps", "seed", "learning_rate", "batch_size", "max_length", "block_size", "num_draft_layers")
"""What makes two drafters of the same data differ: part of the settings hash (save_every is not)."""


@dataclass(frozen=True)
class TrainConfig:
    """dflash_train's params, checked (Airflow checks the schemas; this also serves library callers)."""

    dataset_uri: str | None = None
    tokenization: str = DEFAULT_TOKENIZATION
    drafter_name: str | None = None
    drafters_root: str | None = None
    target_model: str | None = None
    backend: str = "local"
    steps: int = 1000
    seed: int = 0
    learning_rate: float = 6e-4
    batch_size: int = 1
    max_length: int = 4096
    block_size: int = 16
    num_draft_layers: int = 1
    save_every: int = 500
    trainers_python: str | None = None
    trainer_entry: str | None = None
    work_dir: str | None = None
    kubernetes_image: str | None = None
    kubernetes_namespace: str = "default"
    kubernetes_gpus: int = 8
    kubernetes_node_selector: dict[str, str] = field(default_factory=dict)
    kubernetes_service_account: str | None = None
    kubernetes_command: tuple[str, ...] = DEFAULT_KUBERNETES_COMMAND
    aws_conn_id: str = "aws_default"

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> "TrainConfig":
        params = dict(params)
        unknown = sorted(set(params) - set(TRAIN_PARAM_SCHEMAS))
        if unknown:
            raise ConfigError(f"unknown conf key(s) {unknown}; valid keys are {sorted(TRAIN_PARAM_SCHEMAS)}")
        for name, value in params.items():
            _check_schema(name, value, TRAIN_PARAM_SCHEMAS[name])
        values = {n: params.get(n, s.get("default")) for n, s in TRAIN_PARAM_SCHEMAS.items()}
        for name in ("dataset_uri", "drafters_root"):
            if values[name]:
                try:
                    parse_s3_uri(values[name], what=name)
                except UriError as exc:
                    raise ConfigError(str(exc)) from exc
        if not TOKENIZATION_NAME_RE.match(values["tokenization"]):
            raise ConfigError(f"tokenization {values['tokenization']!r}: 1-63 lower-case letters, digits, '_' or '-'")
        if values["drafter_name"] is not None and not DRAFTER_NAME_RE.match(values["drafter_name"]):
            raise ConfigError(f"drafter_name {values['drafter_name']!r}: 1-63 lower-case letters, digits, '.', '_' "
                              "or '-', starting with a letter or digit (it is an S3 path segment)")
        if values["backend"] == "kubernetes" and not values["kubernetes_image"]:
            raise ConfigError("backend 'kubernetes' needs kubernetes_image (the trainer image with SpecForge)")
        if isinstance(values["target_model"], str) and values["target_model"].startswith("s3://"):
            try:
                parse_s3_uri(values["target_model"], what="target_model")
            except UriError as exc:
                raise ConfigError(str(exc)) from exc
        values["kubernetes_command"] = tuple(values["kubernetes_command"])
        values["kubernetes_node_selector"] = dict(values["kubernetes_node_selector"] or {})
        return cls(**values)

    def hyperparameters(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in HYPERPARAMETERS}

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["kubernetes_command"] = list(self.kubernetes_command)
        return out
