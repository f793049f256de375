"""The kubernetes backend: the pod that trains one drafter, as KubernetesPodOperator's kwargs.

A plain function builds them from the checked job and params (image, GPU request and limit, node selector,
service account, the command with the S3 paths filled in), and `check_pod` refuses what would fail only
once the pod is scheduled (an unknown placeholder, no image, a node selector that is not a label map), so a
bad conf fails in `check`, before any pod starts. The kwargs are JSON (they go through XCom to the mapped
operator): resources and the service account ride in `pod_template_dict`, which the operator merges with its
own fields when it builds the pod (`build_pod_request_obj`).
"""

from __future__ import annotations

import math
import re
import shlex
import string
from typing import Any

from dflash_pipeline.config import ConfigError
from dflash_pipeline.config.train import TrainConfig

COMMAND_FIELDS = ("conversations_prefix", "tokens_prefix", "drafter_prefix", "target_model", "chat_template", "gpus",
                  "num_epochs", "steps", "seed", "learning_rate", "batch_size", "max_length", "block_size",
                  "num_draft_layers", "save_every")
GPU_RESOURCE = "nvidia.com/gpu"
CONTAINER = "base"
"""KubernetesPodOperator's name for the container it runs (its `base_container_name` default)."""
_POD_NAME_UNSAFE = re.compile(r"[^a-z0-9-]")


def pod_name(job: dict[str, Any]) -> str:
    """A DNS-1123 name from the drafter's name and settings (the operator adds a random suffix)."""
    base = _POD_NAME_UNSAFE.sub("-", f"dflash-train-{job['name']}".lower())[:40].strip("-")
    return f"{base}-{job['settings_hash'][:8]}"


def epochs_for(steps: int, batch_size: int, gpus: int, rows: int | None) -> int:
    """SpecForge's train_dflash.py counts epochs: the epochs that give at least `steps` steps."""
    if not rows:
        return 1
    return max(1, math.ceil(steps * batch_size * gpus / rows))


def command_values(job: dict[str, Any], cfg: TrainConfig) -> dict[str, str]:
    hp = job["hyperparameters"]
    tok = job["tokenization"]
    rows = tok.get("conversations_rows") or tok.get("rows")
    values: dict[str, Any] = {
        "conversations_prefix": tok["conversations_prefix"], "tokens_prefix": tok["tokens_prefix"],
        "drafter_prefix": job["prefix"], "target_model": job["target_model"],
        "chat_template": tok.get("specforge_template") or "qwen", "gpus": cfg.kubernetes_gpus,
        "num_epochs": epochs_for(hp["steps"], hp["batch_size"], cfg.kubernetes_gpus, rows),
        "save_every": job["save_every"], **hp,
    }
    return {k: shlex.quote(str(values[k])) for k in COMMAND_FIELDS}


def fill_command(template: tuple[str, ...] | list[str], values: dict[str, str]) -> list[str]:
    """Each element of the command with its {placeholders} filled; an unknown one is refused."""
    out = []
    for part in template:
        fields = {f for _, f, _, _ in string.Formatter().parse(part) if f is not None}
        unknown = sorted(fields - set(values))
        if unknown:
            raise ConfigError(f"kubernetes_command: unknown placeholder(s) {unknown}; known: {list(COMMAND_FIELDS)}")
        out.append(part.format(**values))
    return out


def pod_kwargs(job: dict[str, Any], cfg: TrainConfig) -> dict[str, Any]:
    """KubernetesPodOperator kwargs for one drafter's pod (JSON: fit for expand_kwargs)."""
    command = fill_command(cfg.kubernetes_command, command_values(job, cfg))
    gpus = str(cfg.kubernetes_gpus)
    spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "containers": [{"name": CONTAINER,
                        "resources": {"requests": {GPU_RESOURCE: gpus}, "limits": {GPU_RESOURCE: gpus}}}],
    }
    if cfg.kubernetes_service_account:
        spec["serviceAccountName"] = cfg.kubernetes_service_account
    kwargs = {
        "name": pod_name(job),
        "namespace": cfg.kubernetes_namespace,
        "image": cfg.kubernetes_image,
        "cmds": command[:1],
        "arguments": command[1:],
        "node_selector": dict(cfg.kubernetes_node_selector),
        "labels": {"app": "dflash-train", "dflash-drafter": job["name"][:63],
                   "dflash-settings": job["settings_hash"][:16]},
        "pod_template_dict": {"apiVersion": "v1", "kind": "Pod", "metadata": {}, "spec": spec},
    }
    check_pod(kwargs)
    return kwargs


_LABEL_KEY = re.compile(r"^([a-z0-9]([-a-z0-9.]*[a-z0-9])?/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_LABEL_VALUE = re.compile(r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$")


def check_pod(kwargs: dict[str, Any]) -> None:
    """Refuse, before any pod starts, what the API server or the scheduler would refuse later."""
    if not kwargs.get("image"):
        raise ConfigError("kubernetes: no image (kubernetes_image)")
    if not kwargs.get("cmds"):
        raise ConfigError("kubernetes: empty command (kubernetes_command)")
    for k, v in {**kwargs["node_selector"], **kwargs["labels"]}.items():
        if not _LABEL_KEY.match(k) or not isinstance(v, str) or not _LABEL_VALUE.match(v):
            raise ConfigError(f"kubernetes: {k!r}: {v!r} is not a valid label (node_selector keys and values must "
                              "be Kubernetes label names and values)")
    spec = kwargs["pod_template_dict"]["spec"]
    gpus = spec["containers"][0]["resources"]["limits"][GPU_RESOURCE]
    if int(gpus) < 1:
        raise ConfigError("kubernetes: the pod must ask for at least one GPU")
    if len(kwargs["name"]) > 63:
        raise ConfigError(f"kubernetes: pod name {kwargs['name']!r} longer than 63 characters")
