"""A run's teacher cache written from its config (`sft distill cache`, and the bench's `distill_cached` case): the
rows a run of the config trains, the teacher its `+teacher` names, its logits kept where `loss.teacher_cache` says
(`sft.model.teacher_cache`)."""

from __future__ import annotations

from omegaconf import DictConfig

from sft.config.schema import ConfigError


def write_teacher_cache(cfg: DictConfig, device: str | None = None):
    """Write the cache of a checked config with `loss=distill`, `+teacher` and `loss.teacher_cache` (the dir); the
    teacher on `device` (default: the GPU where there is one). Returns its `CacheMeta`."""
    import torch
    from hydra.utils import instantiate
    from transformers import set_seed

    from sft.data.load import load_sft_datasets
    from sft.data.tokens.collator import WeightedDataCollator
    from sft.data.tokens.weights import scores_used_by
    from sft.loss.base import build_loss
    from sft.model.reference_scores import model_identity
    from sft.model.second_model import load_second_model
    from sft.model.teacher_cache import write_cache
    from sft.run.build import controllers_of

    loss = build_loss(cfg.loss)
    if not hasattr(loss, "teacher_cache"):
        raise ConfigError("loss", cfg.loss._target_, "reads no cached teacher: loss=distill")
    if loss.teacher_cache is None:
        raise ConfigError("loss.teacher_cache", None, "the dir to write the cache to: set it (and train with the same "
                          "loss.teacher_cache)")
    if cfg.get("teacher") is None:
        raise ConfigError("teacher", None, "the teacher to cache: add +teacher=path teacher.name_or_path=<its dir> "
                          "(sft/conf/teacher/)")
    tokenizer = instantiate(cfg.tokenizer)
    spec = instantiate(cfg.data, _convert_="object")
    # the rows a run of this config trains: the same scores required (a row without one is left out alike)
    data = load_sft_datasets(spec, tokenizer, loss,
                             scores_needed_by=scores_used_by(loss, controllers_of(cfg.controllers)))
    set_seed(cfg.trainer.seed)  # a random-init teacher built as a run builds it
    packed = bool(cfg.data.packing)
    teacher = load_second_model(cfg.teacher, "teacher", tokenizer, packed)
    teacher.to(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return write_cache(loss.teacher_cache, teacher, data, WeightedDataCollator(tokenizer, packing=packed),
                       loss.top_k, model_identity(cfg.teacher, cfg.trainer.seed), packed)
