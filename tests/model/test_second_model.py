"""The second model a loss reads (`sft.model.second_model`): one whose tokenizer gives other ids is refused in one line
naming the tokens; the config refuses a loss without the model it reads, a teacher or reference nothing reads, and the
engines it cannot run under, each naming the field; a run anchors to the model as it starts, from the command line."""

import json
import shutil

import pytest
from conftest import composed, run_train

from sft.config.schema import ConfigError
from sft.config.validate import check
from sft.model.loading import tiny_model_dir
from sft.model.second_model import check_vocabulary


def test_a_teacher_whose_tokenizer_gives_other_ids_is_refused_naming_them(tmp_path, tokenizer):
    teacher = tmp_path / "teacher"
    shutil.copytree(tiny_model_dir(), teacher)
    spec = json.loads((teacher / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["!"], vocab['"'] = vocab['"'], vocab["!"]  # two tokens swap their ids: every text still encodes
    (teacher / "tokenizer.json").write_text(json.dumps(spec))
    check_vocabulary(str(tiny_model_dir()), None, tokenizer)  # the model's own: nothing to say
    with pytest.raises(ConfigError) as refused:
        check_vocabulary(str(teacher), None, tokenizer)
    message = str(refused.value)
    assert message.startswith(f"teacher.name_or_path={str(teacher)!r}: its tokenizer gives other ids than the model's")
    assert "(2 of 312 tokens differ; teacher vs model: '!': 4 vs 3, '\"': 3 vs 4)" in message
    with pytest.raises(ConfigError, match="^reference.name_or_path="):
        check_vocabulary(str(teacher), None, tokenizer, role="reference")


@pytest.mark.parametrize("overrides, message", [
    (["loss=distill"], "loss: DistillLoss reads a teacher's logits and the config has none: add +teacher=<option>"),
    (["+teacher=tiny"], "teacher='tiny': loss sft.loss.builtin.HardSampleLoss reads no teacher: drop +teacher, or use "
                        "loss=distill"),
    (["loss=distill", "+teacher=tiny", "teacher.quantization=nf4"], "teacher.quantization='nf4': a teacher is read, "
                                                                    "not trained"),
    (["loss=distill", "+teacher=tiny", "deepspeed=zero3"], "teacher='tiny': not with DeepSpeed ZeRO-3"),
    (["loss=distill", "+teacher=path"], "teacher.name_or_path: missing"),
    (["loss=asft"], "loss: ASFTLoss reads a reference's logits and the config has none: add +reference=<option>"),
    (["loss=dft", "+reference=model"], "reference='tiny': loss sft.loss.builtin.DFTLoss reads no reference: drop "
                                       "+reference, or use loss=asft"),
    (["loss=distill", "+reference=model", "+teacher=tiny"], "reference='tiny': loss sft.loss.builtin.DistillLoss reads "
                                                            "no reference"),
    (["loss=asft", "+reference=model", "model=qwen2_5_1_5b_random"], "reference='tiny': the model's weights are "
                                                                     "random"),
])
def test_the_config_refuses_what_a_teacher_cannot_do_naming_the_field(overrides, message):
    with pytest.raises(ConfigError, match="^" + message.replace("(", r"\(").replace(")", r"\)").replace("+", r"\+")):
        check(composed(*overrides))


def test_a_distillation_composes_with_the_teachers_knobs_and_a_reference_is_the_model_as_it_starts():
    cfg = composed("loss=distill", "+teacher=tiny", "teacher.dtype=bfloat16", "loss.divergence=jsd")
    check(cfg)
    assert (cfg.teacher.name_or_path, cfg.teacher.dtype, cfg.loss.divergence) == ("tiny", "bfloat16", "jsd")
    cfg = composed("loss=asft", "+reference=model", "model=smollm2_135m", "lora=default")
    assert (cfg.reference.name_or_path, cfg.reference.gguf_file) == (cfg.model.name_or_path, cfg.model.gguf_file)


@pytest.mark.slow  # a run of its own (about 5 s); a distillation's runs: tests/e2e/test_distributed.py
def test_a_run_anchors_to_the_model_as_it_starts_from_the_command_line(tmp_path):
    proc = run_train("loss=asft", "+reference=model", "data.packing=true", "trainer.max_steps=2",
                     "trainer.logging_steps=1", f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = (tmp_path / "train.log").read_text()
    assert "reference: tiny (Qwen2ForCausalLM, " in log
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics if "loss" in m][:2] == [1, 2]
