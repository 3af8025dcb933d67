"""Value checks (`sft.config.validate`): each schema's check names the field and the bad value, in one line on the
command line (exit code 2)."""

import pytest
from conftest import assert_cli_refuses, composed, fast_loop, run_train

from sft.config import ConfigError, check


BAD_VALUES = [
    (["trainer.learning_rate=0"], "trainer.learning_rate"),
    (["trainer.per_device_train_batch_size=0"], "trainer.per_device_train_batch_size"),
    (["trainer.gradient_accumulation_steps=0"], "trainer.gradient_accumulation_steps"),
    (["trainer.max_steps=0"], "trainer.max_steps"),
    (["trainer.fp16=true", "trainer.bf16=true"], "trainer.fp16"),
    (["loss.min_weight=-1"], "loss.min_weight"),
    (["loss.min_weight=5", "loss.max_weight=2"], "loss.min_weight"),
    (["loss.alpha=inf"], "loss.alpha"),
    (["data.max_length=2"], "data.max_length"),
    (["data.train_file=/does/not/exist.jsonl"], "data.train_file"),
    (["data.default_score=-1"], "data.default_score"),
    (["clip.max_norm=-1"], "clip.max_norm"),
    (["lora=default", "lora.r=0"], "lora.r"),
    (["resume=/no/such/checkpoint"], "resume"),
    (["lora=qlora"], "model.quantization"),
    (["model.quantization=nf4"], "model.quantization"),
    (["deepspeed=zero3", "deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save=false"],
     "deepspeed.zero_optimization.stage3_gather_16bit_weights_on_model_save"),
    (["deepspeed=zero2", "+deepspeed.zero_optimization.offload_param={device: cpu}"],
     "deepspeed.zero_optimization.offload_param"),
    (["deepspeed=zero2", "deepspeed.zero_optimization.stage=4"], "deepspeed.zero_optimization.stage"),
    (["fsdp=full_shard", "deepspeed=zero3"], "fsdp"),
    (["fsdp=full_shard", "deepspeed=zero2"], "fsdp"),
    (["fsdp=full_shard", "fsdp.layers=[]"], "fsdp.layers"),
    (["clip=autoclip", "clip.percentile=0"], "clip.percentile"),
    (["clip=zclip", "clip.alpha=1.5"], "clip.alpha"),
    (["clip=zclip", "clip.warmup_steps=0"], "clip.warmup_steps"),
    (["+controllers=early_stopping", "controllers.early_stopping.patience=0"], "controllers.early_stopping.patience"),
    (["+controllers=lr_plateau", "controllers.lr_plateau.factor=2"], "controllers.lr_plateau.factor"),
    (["+controllers=curriculum", "controllers.curriculum.min_temperature=5"], "controllers.curriculum.min_temperature"),
    (["+controllers=curriculum", "controllers.curriculum.factor=1"], "controllers.curriculum.factor"),
    (["+controllers=adaptive_eval", "controllers.adaptive_eval.min_steps=900"], "controllers.adaptive_eval.min_steps"),
    (["+controllers=adaptive_eval", "controllers.adaptive_eval.slow=0.5"], "controllers.adaptive_eval.slow"),
    (["+controllers=curriculum", "data=jsonl", "data.train_file=sft/sample_data/train.jsonl"], "controllers.curriculum"),
    (["+controllers=early_stopping", "trainer.eval_strategy=no"], "controllers.early_stopping"),
    (["controllers.guard.max_consecutive=0"], "controllers.guard.max_consecutive"),
    (["controllers.guard.spike_factor=0.5"], "controllers.guard.spike_factor"),
    (["controllers.watchdog.timeout_s=0"], "controllers.watchdog.timeout_s"),
    (["controllers.watchdog.timeout_s=3600"], "controllers.watchdog.timeout_s"),
    (["eval_buckets=[3.0,1.0]"], "eval_buckets"),
    (["loss=ce", "loss.chunk_tokens=0"], "loss.chunk_tokens"),
    (["throughput.peak_tflops=0"], "throughput.peak_tflops"),
]
# One of each kind of node in the fast loop; every one in the whole suite.
FAST_BAD_VALUES = {"trainer.learning_rate=0", "trainer.fp16=true trainer.bf16=true",
                   "loss.min_weight=5 loss.max_weight=2", "data.train_file=/does/not/exist.jsonl", "lora=qlora",
                   "deepspeed=zero2 deepspeed.zero_optimization.stage=4", "fsdp=full_shard deepspeed=zero3",
                   "clip=zclip clip.alpha=1.5",
                   "+controllers=early_stopping trainer.eval_strategy=no", "controllers.watchdog.timeout_s=0",
                   "eval_buckets=[3.0,1.0]"}


@pytest.mark.parametrize("overrides, key", fast_loop(BAD_VALUES, FAST_BAD_VALUES,
                                                     ids=[" ".join(overrides) for overrides, _ in BAD_VALUES]))
def test_bad_values_are_rejected_naming_the_field(overrides, key):
    with pytest.raises(ConfigError) as e:
        check(composed(*overrides))
    assert e.value.key == key and str(e.value).startswith(key)


def test_cli_bad_value_exits_2_with_one_line_and_no_traceback():
    proc = run_train("trainer.learning_rate=-1")
    assert proc.returncode == 2
    assert "trainer.learning_rate=-1.0: must be a finite number > 0" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_unknown_key_fails_naming_it():
    proc = run_train("loss.nope=1")
    assert proc.returncode != 0 and "nope" in proc.stderr and "Traceback" not in proc.stderr


def test_cli_bad_data_names_file_line_and_field(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "q"}], "difficulty_score": 1}\n')
    assert_cli_refuses(tmp_path, f"{bad}:1: messages: no assistant turn", "data=jsonl", f"data.train_file={bad}")


@pytest.mark.parametrize("overrides, key, message", [
    (["+controllers.x._target_=shutil.copyfile", "+controllers.x.src=/etc/hostname", "+controllers.x.dst={dst}"],
     "controllers.x._target_", "must be sft.training.controllers.base.Controller or a class extending it"),
    (["loss._target_=shutil.copyfile"], "loss._target_", "must be sft.loss.base.WeightedTokenLoss or a class extending it"),
    (["+loss.aux.x._target_=shutil.copyfile"], "loss.aux.x._target_", "must be sft.loss.auxiliary.AuxTerm"),
    (["clip._target_=sft.training.controllers.EarlyStopping"], "clip._target_",
     "must be sft.training.step.clipping.GradClipPolicy or a class extending it"),
    (["collator._target_=os.system"], "collator._target_", "must be sft.data.tokens.collator.WeightedDataCollator"),
    (["model._target_=shutil.rmtree"], "model._target_", "must be sft.model.loading.load_model"),
    (["+model.random_init.x._target_=shutil.rmtree"], "model.random_init.x._target_",
     "nothing is built from a _target_ here"),
])
def test_a_target_is_checked_against_what_its_node_builds_before_anything_is_called(tmp_path, overrides, key,
                                                                                    message):
    # +controllers.x._target_=shutil.copyfile once copied a file before the node was refused (issue 33).
    dst = tmp_path / "written"
    with pytest.raises(ConfigError) as e:
        check(composed(*(o.format(dst=dst) for o in overrides)))
    assert str(e.value).startswith(key) and message in str(e.value)
    assert not dst.exists()


def test_targets_of_your_own_that_extend_the_nodes_class_pass(tmp_path):
    import sys

    from conftest import REPO

    sys.path.insert(0, str(REPO / "examples" / "own_loss"))
    try:
        check(composed(f"hydra.searchpath=[file://{REPO}/examples/own_loss/conf]", "loss=domain_weighted"))
        check(composed("clip._target_=sft.training.step.clipping.ZClip", "+controllers=early_stopping"))
    finally:
        sys.path.remove(str(REPO / "examples" / "own_loss"))


@pytest.mark.parametrize("override", [
    "+model.random_init.x=[{_target_:shutil.copyfile,src:a,dst:b}]",
    "+model.config_overrides.x=[1,{_target_:shutil.copyfile,src:a,dst:b}]",
    "+tokenizer.chat_template_kwargs.tools=[{_target_:shutil.copyfile,src:a,dst:b}]",
])
def test_a_target_inside_a_list_is_refused_like_one_in_a_dict(override):
    """Hydra's instantiate builds a `_target_` wherever it is, inside lists too."""
    with pytest.raises(ConfigError, match=r"\._target_='shutil.copyfile': nothing is built from a _target_ here"):
        check(composed(override))


def test_a_refused_target_is_not_imported(tmp_path, monkeypatch):
    """Importing a module runs it: a target refused by where it stands is refused by its name alone."""
    (tmp_path / "planted.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').close()\ndef f(): pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="planted.f"):
        check(composed("+model.config_overrides.x={_target_:planted.f}"))
    assert not (tmp_path / "ran").exists()


LATE_FAILURES = [
    ("trainer.adam_beta1=1.5", "trainer.adam_beta1=1.5: must be in [0, 1)"),
    ("trainer.adam_beta2=2", "trainer.adam_beta2=2.0: must be in [0, 1)"),
    ("trainer.adam_epsilon=-1", "trainer.adam_epsilon=-1.0: must be >= 0"),
    ("trainer.seed=-1", "trainer.seed=-1: must be in [0, 2**32 - 1]"),
    ("trainer.num_train_epochs=inf", "trainer.num_train_epochs=inf: must be a finite number > 0"),
    ("trainer.lr_scheduler_kwargs={bogus:1}", "bogus is not a parameter of the cosine schedule "
                                              "(get_cosine_schedule_with_warmup takes: num_cycles, last_epoch)"),
    ("trainer.dataloader_num_workers=-1", "trainer.dataloader_num_workers=-1: must be >= 0"),
    ("trainer.optim_args='momentum=abc'", "trainer.optim_args='momentum=abc': must be key=value pairs"),
    ("data.num_proc=-2", "data.num_proc=-2: must be >= 1"),
    ("eval_buckets=[1,nan]", "eval_buckets=[1.0, nan]: bucket edges must be finite numbers"),
    ("exact_match=default exact_match.max_new_tokens=0", "exact_match.max_new_tokens=0: must be >= 1"),
    ("exact_match=default exact_match.max_rows=-1", "exact_match.max_rows=-1: must be >= 1"),
    ("+controllers=early_stopping controllers.early_stopping.metric=eval_los",
     "controllers.early_stopping.metric='eval_los': not a metric an evaluation reports"),
]


@pytest.mark.parametrize("override, message", fast_loop(
    LATE_FAILURES, {"trainer.adam_beta1=1.5", "trainer.lr_scheduler_kwargs={bogus:1}", "data.num_proc=-2",
                    "+controllers=early_stopping controllers.early_stopping.metric=eval_los"},
    ids=[override for override, _ in LATE_FAILURES]))
def test_values_that_would_fail_late_or_never_act_are_one_config_error_first(override, message):
    """Each of these failed with a traceback when the optimizer, scheduler or loader was built, after the model and
    data (or, a misspelt metric, never acted at all)."""
    with pytest.raises(ConfigError) as error:
        check(composed(*override.split()))
    assert message in str(error.value)


@pytest.mark.slow
@pytest.mark.parametrize("overrides, message", [
    (["fsdp=full_shard", "fsdp.layers=[NoSuchLayer]"], "fsdp.layers=['NoSuchLayer']: NoSuchLayer is no module class "
                                                       "of Qwen2ForCausalLM (its layers: Qwen2DecoderLayer"),
    (["model.attn_implementation=bogus"], "model.attn_implementation='bogus': no such attention (transformers': eager"),
    (["lora=default", "lora.dropot=0.1"], "lora.dropot: not a knob of lora (did you mean lora.lora_dropout?)"),
    (["-m", "trainer.learning_rate=abc,0.001"], "job 0 (trainer.learning_rate=abc): trainer.learning_rate: Value "
                                                "'abc' of type 'str' could not be converted to Float"),
    (["-m", "loss=ce,nonexistent"], "job 1 (loss=nonexistent): loss='nonexistent': no such option"),
    (["eval_harness=sample", "eval_harness.tasks=[nosuchtask]"], "nosuchtask: lm-evaluation-harness has no such task"),
])
def test_the_command_line_says_each_in_one_line(tmp_path, overrides, message):
    assert_cli_refuses(tmp_path, message, *overrides)
