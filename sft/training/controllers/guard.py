"""Non-finite, spiking and diverging steps: skip the update, record the rows, stop after too many in a row, or where
the loss has run away.

`sft.training.step.control` asks for a verdict on each optimizer step once its global gradient norm is known
(`judge_step`). A step whose loss or gradient norm is not finite is skipped: gradients are dropped before
the optimizer step, so parameters and optimizer state stay bit-identical, and the scheduler does not
advance. A step whose loss exceeds `spike_factor` times the running EMA of step losses is a spike:
recorded, and skipped too with `skip_spikes`. After `max_consecutive` skipped steps in a row the run
saves a checkpoint and stops, and ends as failed (`failure`).

A divergence is finite: a learning rate too high for the model sends the loss up and keeps it there (SmolLM2-135M
fully fine-tuned at 2e-3: 0.86, 0.93, then 7.5 and on). Where the median loss of the last 3 steps is `divergence_factor`
times the lowest its EMA has been and 2 nats above it, the run stops without a checkpoint (the weights have run away)
and fails naming the learning rate and the last checkpoint before the rise. One noisy batch moves no median of three;
the 2 nats keep a loss near 0 that triples, or a curriculum's harder rows, from reading as one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sft.config.schema import config_schema, knob
from sft.training.controllers.base import Controller, StepVerdict, log

NONFINITE = "nonfinite"
SPIKE = "spike"
HISTORY = 50  # good steps remembered, to tell a blow-up that began before the bad steps
DIVERGING = 2.0  # a loss this many times its EMA, up to the bad steps: the weights were blowing up
DIVERGENCE_WINDOW = 3  # steps whose median loss is judged for a divergence
DIVERGENCE_MARGIN = 2.0  # nats a diverged loss is above its lowest EMA, besides divergence_factor times it


@config_schema("controllers", "guard")
@dataclass(eq=False, kw_only=True)
class TrainingGuard(Controller):
    _target_: str = "sft.training.controllers.TrainingGuard"
    max_consecutive: int = knob(3, "skipped steps in a row after which the run saves, stops and fails")
    spike_factor: float = knob(0.0, "0: no spike detection; e.g. 3.0 flags a step loss above 3x its EMA")
    spike_ema: float = knob(0.9, "the step-loss EMA's decay")
    spike_warmup: int = knob(10, "steps before spikes are judged")
    skip_spikes: bool = knob(False, "skip a spike's update too (else it is only reported)")
    divergence_factor: float = knob(3.0, "stop, failed, where the median loss of the last 3 steps is this many times "
                                    "the lowest of its EMA and 2 nats above it (a finite divergence: the message "
                                    "names the learning rate); 0: off")
    name = "guard"

    def check(self, cfg=None):
        super().check(cfg)
        self.require("max_consecutive", self.max_consecutive >= 1, "must be >= 1")
        self.require("spike_factor", self.spike_factor == 0 or self.spike_factor > 1, "must be 0 (off) or > 1")
        self.require("spike_ema", 0 < self.spike_ema < 1, "must be in (0, 1)")
        self.require("divergence_factor", self.divergence_factor == 0 or self.divergence_factor > 1,
                     "must be 0 (off) or > 1")

    def __post_init__(self):
        super().__post_init__()
        self.consecutive = 0
        self.loss_ema: float | None = None
        self.good_steps = 0
        self.skipped_steps: list[int] = []
        self.spike_steps: list[int] = []
        self.stopped_at_step: int | None = None
        self._output_dir = "."
        self.history: list[tuple[int, float, float | None]] = []  # (step, loss, the loss EMA before it): good steps
        self.lowest_ema: tuple[int, float] | None = None  # (step, the lowest the loss EMA has been)
        self.diverged: dict | None = None  # where the loss ran away: its steps and losses
        self.diverged_stop_step: int | None = None
        self._learning_rate: float | None = None

    def judge(self, step: int, loss: float, grad_norm: float) -> str:
        """`ok`, `nonfinite` or `spike` for a finished step; updates the counters and the loss EMA."""
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            verdict = NONFINITE
        elif (self.spike_factor > 0 and self.loss_ema is not None and self.good_steps >= self.spike_warmup
              and loss > self.spike_factor * self.loss_ema):
            verdict = SPIKE
            self.spike_steps.append(step)
        else:
            verdict = "ok"
        if self.skips(verdict):
            self.consecutive += 1
            self.skipped_steps.append(step)
            return verdict
        self.consecutive = 0
        self.good_steps += 1
        self.history = self.history[-(HISTORY - 1):] + [(step, loss, self.loss_ema)]
        self.loss_ema = loss if self.loss_ema is None else self.spike_ema * self.loss_ema + (1 - self.spike_ema) * loss
        if self.lowest_ema is None or self.loss_ema < self.lowest_ema[1]:
            self.lowest_ema = (step, self.loss_ema)
        self.judge_divergence(step)
        return verdict

    def judge_divergence(self, step: int) -> None:
        """Whether the loss has run away by step `step` (a good one): the median of the last good steps' losses
        `divergence_factor` times the lowest EMA and `DIVERGENCE_MARGIN` above it; remembered in `diverged`."""
        recent = self.history[-DIVERGENCE_WINDOW:]
        if self.divergence_factor == 0 or self.diverged is not None or len(recent) < DIVERGENCE_WINDOW:
            return
        low_step, low = self.lowest_ema

        def high(loss: float) -> bool:
            return loss > self.divergence_factor * low and loss > low + DIVERGENCE_MARGIN

        median = sorted(loss for _, loss, _ in recent)[len(recent) // 2]
        if high(median):
            self.diverged = {"step": step, "median": median, "lowest_step": low_step, "lowest": low,
                             "since": next(s for s, loss, _ in recent if high(loss))}  # the first step of the rise

    def skips(self, verdict: str) -> bool:
        return verdict == NONFINITE or (verdict == SPIKE and self.skip_spikes)

    def judge_step(self, step: int, loss: float, grad_norm: float) -> StepVerdict | None:
        verdict = self.judge(step, loss, grad_norm)
        if verdict == NONFINITE:
            return StepVerdict(NONFINITE, skip=True, folder="nan_batches", summary="non-finite loss or gradient")
        if verdict == SPIKE:
            return StepVerdict(SPIKE, skip=self.skip_spikes, folder="spikes", summary="loss spike")
        return None

    def on_train_begin(self, args, state, control, **kwargs):
        self.stopped_at_step = None
        self.diverged_stop_step = None
        self._output_dir = args.output_dir
        self._learning_rate = args.learning_rate

    def on_step_end(self, args, state, control, **kwargs):
        if self.diverged is not None and self.diverged_stop_step is None:
            self.diverged_stop_step = state.global_step
            control.should_training_stop = True
            control.should_save = False  # not even a scheduled checkpoint: these weights have run away
            log.error("guard: the loss diverged (the median of the last %d steps %.3g, its lowest mean %.3g at step "
                      "%d): stopping", DIVERGENCE_WINDOW, self.diverged["median"], self.diverged["lowest"],
                      self.diverged["lowest_step"])
        if self.consecutive >= self.max_consecutive and self.stopped_at_step is None:
            self.stopped_at_step = state.global_step
            control.should_save = True  # a resumable checkpoint of the last good parameters
            control.should_training_stop = True
            log.error("guard: %d bad steps in a row (last: step %d): stopping with a checkpoint",
                      self.consecutive, state.global_step)

    def log_values(self) -> dict:
        return {"guard/skipped_steps": len(self.skipped_steps), "guard/spikes": len(self.spike_steps)}

    def diverging_since(self) -> int | None:
        """The first of the last good steps whose loss rose to twice its EMA or more, and stayed up to the bad
        steps: where the weights began to blow up (the bad steps only showed it); None where the loss did not rise."""
        rising = None
        for step, loss, ema in self.history:
            if ema is not None and loss >= DIVERGING * ema:
                rising = step if rising is None else rising
            else:
                rising = None
        return rising

    def rate(self) -> str:
        """The run's peak learning rate, as the knob that sets it."""
        return f"trainer.learning_rate={self._learning_rate:g}" if self._learning_rate else "trainer.learning_rate"

    def divergence_failure(self) -> str:
        from sft.training.checkpoints.store import checkpoints

        d, out = self.diverged, self._output_dir
        before = [path for step, path, complete in checkpoints(out) if complete and step < d["since"]]
        where = f"resume={before[-1]}" if before else "a new run (no checkpoint precedes it)"
        return (f"the loss diverged: its running mean was {d['lowest']:.3g} at step {d['lowest_step']}, and the last "
                f"{DIVERGENCE_WINDOW} steps' median is {d['median']:.3g} at step {d['step']} (rising from step "
                f"{d['since']}). The learning rate is too high for this model: {self.rate()}. Stopped without "
                f"a checkpoint (these weights have run away). Lower it (a tenth: trainer.learning_rate="
                f"{(self._learning_rate or 0) / 10:g}; a longer trainer.warmup_steps helps too) and start from "
                f"before step {d['since']}: {where}; controllers.guard.divergence_factor=0 turns this check off")

    def failure(self) -> str | None:
        if self.stopped_at_step is None:
            return self.divergence_failure() if self.diverged_stop_step is not None else None
        from sft.training.checkpoints.store import checkpoints

        out = self._output_dir
        head = (f"{self.consecutive} bad steps in a row (non-finite loss or gradient, or skipped spikes), the last at "
                f"step {self.stopped_at_step}: stopped with checkpoint-{self.stopped_at_step} in {out}. ")
        since = self.diverging_since()
        if since is None:  # finite and steady until the bad steps, which changed no weight: the saved ones are sound
            return head + (f"The loss was steady before them, and skipped steps change no weight: the rows named in "
                           f"{out}/nan_batches/ (and spikes/) are the likely cause; fix or drop them (data.on_error, "
                           "controllers.guard.*), then resume with resume=auto")
        before = [path for step, path, complete in checkpoints(out) if complete and step < since]
        where = f"resume={before[-1]}" if before else "a new run (no checkpoint precedes it)"
        return head + (f"Its weights are not sound: the loss had risen to twice its running mean and more from step "
                       f"{since} on, before any step went non-finite (the rows of the bad steps only showed it). "
                       f"Continue from before step {since}: {where}, with a lower learning rate than {self.rate()} "
                       "(or clip=autoclip); resume=auto would continue from the blown-up weights")
