"""The trainer's parts (`sft.training.parts`): each made from its own config section, each read by the class that
owns it."""

from conftest import composed


def test_each_part_reaches_the_class_that_owns_it(tmp_path):
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from transformers import TrainingArguments

    from sft.loss.builtin import CrossEntropyLoss
    from sft.model.loading import load_model
    from sft.training.checkpoints.sharded import CheckpointConfig
    from sft.training.parts import Display, EvaluationParts, StepParts
    from sft.training.step.clipping import StaticClip
    from sft.training.trainer import WeightedLossTrainer

    cfg = composed("trainer.precision=pure", "trainer.bf16=true", "trainer.oom_retry=false")
    clip = StaticClip(max_norm=0.5)
    step = StepParts.of(cfg.trainer, clip, {}, micro_batch_tokens=None, sources=["rows.jsonl"])
    assert step.master_weights and not step.oom_retry and step.clip_policy is clip
    checkpoints = CheckpointConfig(**OmegaConf.to_container(cfg.checkpoint, resolve=True))
    assert not checkpoints.async_save
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], remove_unused_columns=False)
    meter = instantiate(cfg.throughput)
    trainer = WeightedLossTrainer(model=load_model("tiny"), args=args, loss=CrossEntropyLoss(), step=step,
                                  evaluation=EvaluationParts([2.0], tasks={1: "chat"}), checkpoints=checkpoints,
                                  shows=Display("json", meter))
    assert trainer.clip_policy is clip and trainer.pure_bf16 and trainer.throughput is meter
    assert trainer.micro_batches.refusal == "trainer.oom_retry=false" and trainer.micro_batches.tokens is None
    assert trainer.eval_buckets == [2.0] and trainer.tasks == {1: "chat"} and trainer.shard_writer is None
    assert meter in trainer.callback_handler.callbacks
    # every part has its defaults: a trainer of Trainer's arguments and a loss
    plain = WeightedLossTrainer(model=load_model("tiny"), args=args, loss=CrossEntropyLoss())
    assert plain.eval_buckets == [1.0, 2.0, 3.0] and plain.controllers == {} and not plain.pure_bf16
