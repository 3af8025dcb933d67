"""The frozen second model a loss reads: a teacher (`+teacher=...`, `loss=distill`'s) or a reference (`+reference=...`,
`loss=asft`'s: the model fine-tuning started from; `loss=reference_weighted`'s: a model trained apart, read once before
training, `sft.model.reference_scores`). Its config (`TeacherConfig`, `ReferenceConfig`), its loading as
the trained model's (`load_second_model`) after its vocabulary is checked to be the trained model's (the loss compares
the two models' distributions id by id: a teacher whose id 17 is another token would teach noise), and its outputs on
each micro-batch (`FrozenModel`). Imports no torch when imported (its schemas are part of the config's composition).

    +teacher=path teacher.name_or_path=<a fine-tuned model's dir>   (sft/conf/teacher/: path, tiny, smollm2_135m)
    +reference=model                     the trained model as it starts (sft/conf/reference/: model, path, tiny)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import ClassVar

from omegaconf import MISSING

from sft.config.schema import ConfigError, config_schema, import_target, knob
from sft.loss.logits import LogitTransform
from sft.model.loading import ModelConfig, resolve

log = logging.getLogger("sft")


@config_schema("teacher", "teacher")
@dataclass
class TeacherConfig(ModelConfig):
    """A frozen model a loss learns from (`loss=distill`): the `model` group's knobs, read and never trained."""

    role: ClassVar[str] = "teacher"  # its config section, and the `second_model` of the losses that read it
    read_by: ClassVar[str] = "loss=distill"
    name_or_path: str = knob(MISSING, "a hub id or a local checkpoint (tiny: the embedded model)")

    def check(self, cfg=None):
        self.check_source()
        self.require("quantization", self.quantization is None, f"a {self.role} is read, not trained: 4-bit "
                     f"quantization is for QLoRA's trained model (set {self.role}.dtype=bfloat16 to halve its memory)")
        self.require("tiled_mlp_tokens", self.tiled_mlp_tokens is None, f"a {self.role} runs no backward: its MLPs "
                     "need no tiles (null)")
        if cfg is None:
            return
        loss = import_target(cfg.loss._target_) if cfg.get("loss") is not None else None
        if getattr(loss, "second_model", None) != self.role:
            raise ConfigError("", self.name_or_path, f"loss {cfg.loss._target_} reads no {self.role}: drop "
                              f"+{self.role}, or use {self.read_by}")
        if cfg.loss.get("teacher_cache") is not None:  # not loaded: the cache is checked to be its (teacher_cache)
            return
        if cfg.get("sp") is not None and int(cfg.sp.get("size", 1)) > 1:
            raise ConfigError("", self.name_or_path, f"not with sequence parallelism (each rank holds a slice of "
                              f"the positions, the {self.role} would need the whole rows): sp=none")
        zero = (cfg.get("deepspeed") or {}).get("zero_optimization", {}) or {}
        if zero.get("stage") == 3:
            raise ConfigError("", self.name_or_path, f"not with DeepSpeed ZeRO-3, which would shard the "
                              f"{self.role}'s weights as it loads them, outside its engine: use deepspeed=zero2 or "
                              f"fsdp=full_shard (the {self.role} whole on each rank)")


@config_schema("reference", "reference")
@dataclass
class ReferenceConfig(TeacherConfig):
    """A frozen model a loss compares the model with: `loss=asft`'s anchor, usually the model fine-tuning started from
    (`+reference=model`); `loss=reference_weighted`'s scorer, a model trained apart (`+reference=path`)."""

    role: ClassVar[str] = "reference"
    read_by: ClassVar[str] = "loss=asft or loss=reference_weighted"

    def check(self, cfg=None):
        super().check(cfg)
        if cfg is None:
            return
        the_model = (self.name_or_path, self.gguf_file) == (cfg.model.name_or_path, cfg.model.gguf_file)
        if cfg.model.random_init and the_model:
            raise ConfigError("", self.name_or_path, "the model's weights are random (model.random_init): a reference "
                              "read from name_or_path is not the model as it starts")
        if the_model and getattr(import_target(cfg.loss._target_), "scores_before_training", False):
            raise ConfigError("name_or_path", self.name_or_path, "is the model itself: every token's excess loss "
                              "would be 0; loss=reference_weighted needs a reference trained apart (+reference=path "
                              "reference.name_or_path=<its dir>)")


def load_second_model(node, role: str, tokenizer, packing: bool):
    """The model of a config's `teacher` or `reference` node (`role`): its vocabulary checked against `tokenizer` (the
    trained model's), with the attention packed rows need where `packing`; the trainer freezes it and puts it on its
    device."""
    from hydra.utils import instantiate

    from sft.model.packing import check_packing

    check_vocabulary(node.name_or_path, node.gguf_file, tokenizer, bool(node.trust_remote_code), role)
    attn = node.attn_implementation
    if packing and attn == "sdpa":  # as the trained model's (sft.run.build.build_model)
        attn = "sdpa_varlen"
    model = instantiate(node, attn_implementation=attn)
    if packing:
        check_packing(model)
    parameters = sum(p.numel() for p in model.parameters())
    log.info("%s: %s (%s, %.1fM parameters, %s)", role, node.name_or_path, type(model).__name__,
             parameters / 1e6, next(model.parameters()).dtype)
    return model


def check_vocabulary(name_or_path: str, gguf_file: str | None, tokenizer, trust_remote_code: bool = False,
                     role: str = "teacher") -> None:
    """The second model's tokenizer must map every token to the trained model's id (`ConfigError` on
    `<role>.name_or_path` otherwise, naming the first tokens that differ): the two distributions are compared id by
    id."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(resolve(name_or_path, gguf_file), trust_remote_code=trust_remote_code)
    ours_vocab, their_vocab = tokenizer.get_vocab(), theirs.get_vocab()
    if ours_vocab == their_vocab:
        return
    differ = sorted(token for token in ours_vocab.keys() | their_vocab.keys()
                    if ours_vocab.get(token) != their_vocab.get(token))
    examples = ", ".join(f"{token!r}: {their_vocab.get(token)} vs {ours_vocab.get(token)}" for token in differ[:3])
    raise ConfigError(f"{role}.name_or_path", name_or_path, f"its tokenizer gives other ids than the model's "
                      f"({len(differ)} of {len(their_vocab)} tokens differ; {role} vs model: {examples}); the loss "
                      "compares the two distributions id by id, so both need one vocabulary")


class FrozenModel:
    """A second model frozen (no gradients, in eval mode: no dropout) on the run's device, and its `outputs` on a
    micro-batch for the loss."""

    def __init__(self, model, device):
        self.model = model.requires_grad_(False).eval().to(device)
        self.transform = LogitTransform.of(model.config)

    def outputs(self, inputs: dict, lean: bool):
        """Its outputs on the micro-batch `inputs` (the trained model's), `sft.loss.terms.SecondOutputs`: its logits,
        or (`lean`: the loss projects them a chunk at a time) its final hidden states and output layer."""
        import torch

        from sft.loss.terms import SecondOutputs

        with torch.no_grad(), torch.profiler.record_function("sft.second_model"):
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
