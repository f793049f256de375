"""dflash_train's params and its kubernetes pod: bad conf refused with a clear message; the pod the provider's
KubernetesPodOperator builds (`build_pod_request_obj`, no cluster needed) carries the image, the GPUs, the node
selector, the service account and SpecForge's command with the run's S3 paths."""

from __future__ import annotations

import pytest

from dflash_pipeline.config import ConfigError, TrainConfig
from dflash_pipeline.steps.train.kubernetes import epochs_for, pod_kwargs

JOB = {
    "name": "qwen3-a", "prefix": "s3://bucket-a/drafters/qwen3-a/", "settings_hash": "ab" * 32,
    "target_model": "Qwen/Qwen3-8B", "save_every": 500,
    "hyperparameters": {"steps": 1000, "seed": 0, "learning_rate": 6e-4, "batch_size": 2, "max_length": 4096,
                        "block_size": 16, "num_draft_layers": 1},
    "tokenization": {"conversations_prefix": "s3://bucket-a/ds/tokenized/specforge-conversations/",
                     "tokens_prefix": "s3://bucket-a/ds/tokenized/specforge/", "specforge_template": "qwen3-thinking",
                     "conversations_rows": 8000, "rows": 8100},
}


def _cfg(**kw: object) -> TrainConfig:
    return TrainConfig.from_params({"dataset_uri": "s3://bucket-a/ds", "backend": "kubernetes",
                                    "kubernetes_image": "lmsysorg/specforge:v0.2.0", **kw})


@pytest.mark.parametrize("conf, message", [
    ({"dataset_uri": "s3://bucket-a/ds", "stepz": 3}, "unknown conf key(s) ['stepz']"),
    ({"dataset_uri": "s3://bucket-a/ds", "steps": 0}, "steps"),
    ({"dataset_uri": "s3://bucket-a/ds", "drafter_name": "Bad Name"}, "drafter_name"),
    ({"dataset_uri": "s3://bucket-a/ds", "backend": "kubernetes"}, "needs kubernetes_image"),
    ({"dataset_uri": "s3://bucket-a/ds", "backend": "slurm"}, "backend"),
    ({"dataset_uri": "s3://B/ds"}, "not a valid S3 bucket name"),
])
def test_bad_conf_is_refused(conf: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)").replace("[", r"\[")):
        TrainConfig.from_params(conf)


def test_the_pod_the_operator_builds() -> None:
    from dflash_pipeline.tasks import kubernetes_pod_operator

    cfg = _cfg(kubernetes_gpus=4, kubernetes_namespace="train",
               kubernetes_node_selector={"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
               kubernetes_service_account="dflash-trainer")
    pod = kubernetes_pod_operator(pod_kwargs(JOB, cfg)).build_pod_request_obj(dry_run=True)
    assert pod.metadata.namespace == "train" and pod.metadata.name.startswith("dflash-train-qwen3-a-abababab")
    assert pod.metadata.labels["dflash-drafter"] == "qwen3-a"
    spec = pod.spec
    assert spec.node_selector == {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"}
    assert spec.service_account_name == "dflash-trainer" and spec.restart_policy == "Never"
    (container,) = spec.containers
    assert container.image == "lmsysorg/specforge:v0.2.0"
    assert container.resources.limits == {"nvidia.com/gpu": "4"} == container.resources.requests
    assert container.command == ["bash"] and container.args[0] == "-c"
    script = container.args[1]
    assert "aws s3 cp --recursive s3://bucket-a/ds/tokenized/specforge-conversations/ /data/parts/" in script
    assert "torchrun --standalone --nproc_per_node 4 scripts/train_dflash.py" in script
    assert "--target-model-path Qwen/Qwen3-8B" in script and "--chat-template qwen3-thinking" in script
    assert f"--num-epochs {epochs_for(1000, 2, 4, 8000)} " in script and epochs_for(1000, 2, 4, 8000) == 1
    assert "--batch-size 2 --learning-rate 0.0006 --max-length 4096 --block-size 16 --num-draft-layers 1" in script
    assert "--save-interval 500 --seed 0" in script and "--resume" in script
    assert script.endswith("aws s3 cp --recursive /out/ s3://bucket-a/drafters/qwen3-a/checkpoints/")


def test_epochs_cover_the_steps() -> None:
    assert epochs_for(1000, 1, 8, 8000) == 1 and epochs_for(1001, 1, 8, 8000) == 2 and epochs_for(5, 1, 1, None) == 1


@pytest.mark.parametrize("kw, message", [
    ({"kubernetes_command": ["bash", "-c", "train {dataset}"]}, r"unknown placeholder\(s\) \['dataset'\]"),
    ({"kubernetes_node_selector": {"bad key!": "x"}}, "not a valid label"),
])
def test_a_bad_pod_is_refused_before_it_starts(kw: dict[str, object], message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        pod_kwargs(JOB, _cfg(**kw))


def test_shell_values_are_quoted() -> None:
    job = {**JOB, "target_model": "/models/q; rm -rf /"}
    script = pod_kwargs(job, _cfg())["arguments"][1]
    assert "--target-model-path '/models/q; rm -rf /'" in script


def test_an_asset_triggered_run_trains_each_tokenization_its_event_names() -> None:
    from types import SimpleNamespace

    from dflash_pipeline.steps.handoff import TOKENIZED_FORMAT, tokenized_datasets
    from dflash_pipeline.steps.train.checks import TrainRefused, jobs_for

    events = [SimpleNamespace(extra={"format": TOKENIZED_FORMAT, "datasets": [
                  {"output_uri": "s3://bucket-a/ds1", "tokenization": "default"},
                  {"output_uri": "s3://bucket-a/ds2", "tokenization": "original"}]}),
              SimpleNamespace(extra={"format": "something-else", "datasets": [{"output_uri": "s3://bucket-a/x"}]})]
    cfg = TrainConfig.from_params({"dataset_uri": "s3://bucket-a/ignored"})
    assert jobs_for(cfg, tokenized_datasets(events)) == [("s3://bucket-a/ds1", "default"),
                                                          ("s3://bucket-a/ds2", "original")]
    assert jobs_for(cfg, []) == [("s3://bucket-a/ignored", "default")]  # by hand: the params
    with pytest.raises(TrainRefused, match="no dflash_tokenized asset event and no dataset_uri"):
        jobs_for(TrainConfig.from_params({}), [])
