"""What a model does to its logits and objective beyond the output projection, which a loss from the hidden
states must repeat: the logit transform (softcapping, scales) and a mixture of experts' router aux loss."""

from __future__ import annotations

from dataclasses import dataclass

from sft.config.schema import ConfigError


@dataclass(frozen=True)
class LogitTransform:
    """What a model does to its logits after the output projection, which a loss from the hidden states
    must repeat: `z * scale`, then, with a `softcap` c, `c * tanh(z / c)`.

        LogitTransform.of(Gemma2Config())    ->  LogitTransform(scale=1.0, softcap=30.0)  (final_logit_softcapping)
        LogitTransform.of(CohereConfig())    ->  LogitTransform(scale=0.0625, softcap=None)  (logit_scale)
        LogitTransform.of(GraniteConfig(logits_scaling=8.0))  ->  LogitTransform(scale=0.125, softcap=None)
    """

    scale: float = 1.0
    softcap: float | None = None

    @classmethod
    def of(cls, config) -> LogitTransform:
        """The transform a transformers config asks for (the attributes its modelling code applies)."""
        scale = float(getattr(config, "logit_scale", None) or 1.0)
        if getattr(config, "logits_scaling", None):
            scale /= float(config.logits_scaling)
        softcap = getattr(config, "final_logit_softcapping", None)
        return cls(scale, float(softcap) if softcap else None)

    def __call__(self, logits):
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = (logits / self.softcap).tanh() * self.softcap
        return logits


def router_aux_loss_coef(config) -> float:
    """The weight of a mixture of experts' router load-balancing loss in the model's own objective; 0 when
    its config does not ask for the loss (`output_router_logits`).

    The model computes the loss (`outputs.aux_loss`) on every forward with `output_router_logits`, but adds
    it to its own loss only when given `labels`, which a weighted loss does not pass: the trainer adds it.

        router_aux_loss_coef(Qwen3MoeConfig(output_router_logits=True))  ->  0.001
        router_aux_loss_coef(Qwen3MoeConfig())                           ->  0.0
    """
    if not getattr(config, "output_router_logits", False):
        return 0.0
    for name in ("router_aux_loss_coef", "aux_loss_coef"):  # JetMoE names it aux_loss_coef
        if getattr(config, name, None) is not None:
            return float(getattr(config, name))
    raise ConfigError("model.config_overrides.output_router_logits", True,
                      f"{type(config).__name__} has no router_aux_loss_coef: the router loss's weight is unknown")
