"""The second model a loss reads (`teacher`: `loss=distill`'s): its config (`TeacherConfig`), loaded as the trained
model is (`load_teacher`) after its vocabulary is checked to be the trained model's (a distillation compares the two
models' distributions id by id, and a teacher whose id 17 is another token would teach noise), and run frozen on each
micro-batch (`Teacher`). Imports no torch when imported (its schema is part of the config's composition).

    +teacher=path teacher.name_or_path=<a fine-tuned model's dir>   (sft/conf/teacher/: tiny, smollm2_135m, path)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from omegaconf import MISSING

from sft.config.schema import ConfigError, config_schema, import_target, knob
from sft.loss.logits import LogitTransform
from sft.model.loading import ModelConfig, resolve

log = logging.getLogger("sft")


@config_schema("teacher", "teacher")
@dataclass
class TeacherConfig(ModelConfig):
    """A frozen second model (`load_teacher`): the `model` group's knobs, read and never trained."""

    name_or_path: str = knob(MISSING, "a hub id or a local checkpoint (tiny: the embedded model)")

    def check(self, cfg=None):
        self.check_source()
        self.require("quantization", self.quantization is None, "a teacher is read, not trained: 4-bit quantization "
                     "is for QLoRA's trained model (set teacher.dtype=bfloat16 to halve its memory)")
        self.require("tiled_mlp_tokens", self.tiled_mlp_tokens is None, "a teacher runs no backward: its MLPs need "
                     "no tiles (null)")
        if cfg is None:
            return
        loss = import_target(cfg.loss._target_) if cfg.get("loss") is not None else None
        if getattr(loss, "second_model", None) != "teacher":
            raise ConfigError("", self.name_or_path, f"loss {cfg.loss._target_} reads no teacher: drop "
                              "+teacher, or use loss=distill")
        if cfg.get("sp") is not None and int(cfg.sp.get("size", 1)) > 1:
            raise ConfigError("", self.name_or_path, "not with sequence parallelism (each rank holds a slice "
                              "of the positions, the teacher would need the whole rows): sp=none")
        zero = (cfg.get("deepspeed") or {}).get("zero_optimization", {}) or {}
        if zero.get("stage") == 3:
            raise ConfigError("", self.name_or_path, "not with DeepSpeed ZeRO-3, which would shard the "
                              "teacher's weights as it loads them, outside its engine: use deepspeed=zero2 or "
                              "fsdp=full_shard (the teacher whole on each rank)")


def load_teacher(node, tokenizer, packing: bool):
    """The teacher of a config's `teacher` node: its vocabulary checked against `tokenizer` (the trained model's),
    with the attention packed rows need where `packing`; the trainer freezes it and puts it on its device."""
    from hydra.utils import instantiate

    from sft.model.packing import check_packing

    check_vocabulary(node.name_or_path, node.gguf_file, tokenizer, bool(node.trust_remote_code))
    attn = node.attn_implementation
    if packing and attn == "sdpa":  # as the trained model's (sft.run.build.build_model)
        attn = "sdpa_varlen"
    teacher = instantiate(node, attn_implementation=attn)
    if packing:
        check_packing(teacher)
    parameters = sum(p.numel() for p in teacher.parameters())
    log.info("teacher: %s (%s, %.1fM parameters, %s)", node.name_or_path, type(teacher).__name__,
             parameters / 1e6, next(teacher.parameters()).dtype)
    return teacher


def check_vocabulary(name_or_path: str, gguf_file: str | None, tokenizer, trust_remote_code: bool = False) -> None:
    """The teacher's tokenizer must map every token to the trained model's id (`ConfigError` on
    `teacher.name_or_path` otherwise, naming the first tokens that differ): the two distributions are compared id by
    id."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(resolve(name_or_path, gguf_file), trust_remote_code=trust_remote_code)
    ours_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours_vocab == their_vocab:
        return
    differ = sorted(token for token in ours_vocab.keys() | their_vocab.keys()
                    if ours_vocab.get(token) != their_vocab.get(token))
    examples = ", ".join(f"{token!r}: {their_vocab.get(token)} vs {ours_vocab.get(token)}" for token in differ[:3])
    raise ConfigError("teacher.name_or_path", name_or_path, f"its tokenizer gives other ids than the model's "
                      f"({len(differ)} of {len(their_vocab)} tokens differ; teacher vs model: {examples}); a "
                      "distillation compares the two distributions id by id, so both need one vocabulary")


class Teacher:
    """A frozen model (no gradients, in eval mode: no dropout) on the run's device, and its `outputs` on a micro-batch
    for the loss."""

    def __init__(self, model, device):
        self.model = model.requires_grad_(False).eval().to(device)
        self.transform = LogitTransform.of(model.config)

    def outputs(self, inputs: dict, lean: bool):
        """Its outputs on the micro-batch `inputs` (the trained model's), `sft.loss.terms.SecondOutputs`: its logits,
        or (`lean`: the loss projects them a chunk at a time) its final hidden states and output layer."""
        import torch

        from sft.loss.terms import SecondOutputs

        with torch.no_grad(), torch.profiler.record_function("sft.teacher"):
            if not lean:
                return SecondOutputs(logits=self.model(**inputs, use_cache=False).logits)
            no_logits = torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device)
            _, hidden = forward_keeping_hidden(self.model, self.model.get_decoder(), **inputs, logits_to_keep=no_logits)
        return SecondOutputs(hidden=hidden, lm_head=self.model.get_output_embeddings().weight, transform=self.transform)

    def parameters(self):
        return self.model.parameters()


def forward_keeping_hidden(model, decoder, **inputs):
    """`model`'s forward (no KV cache), and the output of its `decoder` (`model.get_decoder()`, unwrapped): the final
    hidden states."""
    hidden = {}

    def keep_hidden_states(module, args, output):  # returns None: the output itself goes on unchanged
        hidden["states"] = output[0]

    hook = decoder.register_forward_hook(keep_hidden_states)
    try:
        outputs = model(**inputs, use_cache=False)
    finally:
        hook.remove()
    return outputs, hidden["states"]
