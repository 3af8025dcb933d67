"""The bench's cases, one table (`CASES`): each case is one `Case` (its name, what it runs, its overrides, what it needs
and which ratios it feeds), so that adding a case is a row here and, where it runs something new, its function.

    Case("packing", TRAINING, run=run_training_case, overrides=("loss=ce", "data.packing=true"),
         ratios={"packing_gain": Ratio("ce", target=1.3)})
      ->  python -m sft.bench trains it beside `ce`, each round, and reports packing_gain = its tokens/s over ce's

The kinds: a training case trains `bench.steps` steps at each of `bench.batch_sizes` (`sft.bench.training`); an eval
case times `Trainer.evaluate()`; a loss case the loss alone (`sft.bench.loss_cases`); a matmul case the machine's
matrix products at the model's shapes (`sft.bench.matmul`). Those run in rounds, interleaved (`sft.bench.run`). A case
run once (`ONCE`) has a driver instead (`drive`), which runs its function in fresh processes as it needs (the data
cases, long rows, a checkpoint's memory, start-up)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from sft.bench.checkpoint_memory import drive_checkpoint_memory, show_checkpoint_memory
from sft.bench.data_cases import (drive_checksums, drive_preprocess, drive_scale, drive_stream, drive_tokenize,
                                  run_checksums_case, run_preprocess_case, run_scale_case, run_stream_case,
                                  run_tokenize_case, show_checksums, show_preprocess, show_scale, show_stream,
                                  show_tokenize)
from sft.bench.long_rows import drive_long_rows, run_long_rows_case, show_long_rows
from sft.bench.loss_cases import run_loss_case, show_loss
from sft.bench.matmul import run_matmul_case, show_matmul
from sft.bench.startup import drive_startup
from sft.bench.training import CACHE_IN_SCRATCH, run_eval_case, run_training_case, show_eval

TRAINING, EVAL, LOSS, MATMUL, ONCE = "training", "eval", "loss", "matmul", "once"
NEEDS = ("trl", "bf16", "gpu", "liger", "flash")  # `sft.bench.device.missing` says why each is missing here


@dataclass(frozen=True)
class Ratio:
    """A figure a case feeds. With `versus`: the case's `key` over `versus`'s, in each round both ran (a training case's
    at each batch size, `_b16` added to the name), the median reported with the rounds' spread; `memory`: also
    `<name>_memory`, peak memory over peak memory. Without: a figure the bench computes for the case (its hardware
    ratios, its MFU: `mfu_<case>`) or the case's driver returns. `target`: at least it, or at most with `at_most`.
    `when`: fed only where the case's first result says so (a kernel that ran under its own name)."""

    versus: str | None = None
    key: str = "tokens_per_second"
    target: float | None = None
    at_most: bool = False
    memory: bool = False
    when: Callable[[dict], bool] | None = None


@dataclass(frozen=True)
class Case:
    """One case of `python -m sft.bench`: its `kind`, what runs in its own process (`run(case, cfg) -> result`), the
    training config's `overrides` it runs with, what it `needs` (else it is skipped, said in one line), whether it
    runs only when `bench.cases` names it (`on_request`), its rows (`spread`: the published length spread,
    `sft.bench.rows`), whether it trains `bench.full_model`, the ratios it feeds (by name), whether `bench.isolate=false`
    runs it in the bench's own process (`inline`), the driver of a case run once (`drive(context) -> (figures,
    ratios)`) and its lines in the printed report (`show(name, report)`)."""

    name: str
    kind: str
    run: Callable[[str, object], dict] | None = None
    overrides: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()
    on_request: bool = False
    spread: bool = False
    full_model: bool = False
    ratios: dict[str, Ratio] = field(default_factory=dict)
    inline: bool = False
    drive: Callable | None = None
    show: Callable[[str, dict], list[str]] | None = None

    def __post_init__(self):
        assert self.kind in (TRAINING, EVAL, LOSS, MATMUL, ONCE), self.kind
        assert set(self.needs) <= set(NEEDS), self.needs
        assert (self.drive is not None) == (self.kind == ONCE), self.name


@dataclass
class Context:
    """What a case run once is given (`Case.drive`): the bench's overrides and composed config (`base.bench`), and how to
    compose another config, run a case's function in a process of its own (`spawn(case, cfg, env=None, processes=1)`)
    and find a free port."""

    overrides: list[str]
    base: object
    compose: Callable
    spawn: Callable
    free_port: Callable


def training(name: str, *overrides: str, **knobs) -> Case:
    """A training case: it trains `bench.steps` steps with `overrides`, at each batch size (`sft.bench.training`)."""
    return Case(name, TRAINING, run=run_training_case, overrides=overrides, inline=True, **knobs)


def loss_kernel(name: str, impl: str, **knobs) -> Case:
    """A loss case: the loss alone, computed as `loss.impl=impl` (`sft.bench.loss_cases`)."""
    return Case(name, LOSS, run=run_loss_case, overrides=(f"loss.impl={impl}",), show=show_loss, **knobs)


def kernel_ran(impl: str) -> Callable[[dict], bool]:
    """Whether a loss case ran `impl` (a kernel not usable here runs another: no ratio in its name)."""
    return lambda result: result["impl"] == impl


def versus_naive_loss(kernel: str, target_memory: float | None = None, target_time: float | None = None,
                      when=None) -> dict[str, Ratio]:
    """A lean loss kernel's memory and time over the naive loss's."""
    return {f"{kernel}_vs_naive_loss_memory": Ratio("loss_naive", "peak_memory_gb", target_memory, True, when=when),
            f"{kernel}_vs_naive_loss_time": Ratio("loss_naive", "seconds", target_time, True, when=when)}


# `raw`, `hf`, `ce_naive` and `trl` compute the same full logits and cross entropy (the framework's cost alone); `ce`
# and `packing` the lean loss `loss.impl=auto` picks; the packed cases all run the sdpa_varlen kernel but
# `trl_padding_free_mask` (TRL's own: a block-diagonal mask) and `packing_flex` (FlexAttention's document mask).
# `trl_best` and `hf_padding_free` are TRL's SFTTrainer and a plain Trainer each at its own fastest documented
# settings (`sft.bench.training.fastest_settings`), on their own attention, not the sdpa_varlen sft's packing turns
# sdpa into. What each measures: `sft.bench.run`'s docstring.
PACKED = ("loss=ce", "data.packing=true")
TEACHER_IS_THE_MODEL = ("+teacher=path", *(f"teacher.{knob}=${{model.{knob}}}" for knob in
                                           ("name_or_path", "gguf_file", "random_init", "dtype")))
TABLE = (
    training("raw", "loss=ce", "loss.impl=naive"),
    training("hf"),
    training("ce_naive", "loss=ce", "loss.impl=naive", ratios={"sft_vs_raw": Ratio("raw", target=0.95),
                                                                "overhead_vs_hf": Ratio("hf", target=0.97)}),
    training("ce", "loss=ce", ratios={"lean_loss_gain": Ratio("ce_naive", memory=True),
                                      "ce_vs_trl": Ratio("trl", target=1.0, memory=True),
                                      "hw_exec_ce": Ratio(target=0.80)}),
    training("ce_bf16", "loss=ce", "trainer.bf16=true", needs=("bf16",),
             ratios={"bf16_mixed_vs_fp32": Ratio("ce"), "hw_exec_ce_bf16": Ratio(target=0.60)}),
    training("ce_bf16_pure", "loss=ce", "trainer.bf16=true", "trainer.precision=pure", needs=("bf16",),
             ratios={"bf16_vs_fp32": Ratio("ce", target=1.8), "pure_vs_mixed": Ratio("ce_bf16")}),
    training("ce_lora", "loss=ce", "lora=default", ratios={"lora_vs_full": Ratio("ce", target=1.25),
                                                           "lean_loss_gain_lora": Ratio("ce_lora_naive", memory=True)}),
    training("ce_lora_naive", "loss=ce", "lora=default", "loss.impl=naive"),
    training("ce_compiled", "loss=ce", "trainer.torch_compile=true", on_request=True,  # minutes of compiling
             ratios={"compile_gain": Ratio("ce")}),
    training("hard_sample", "loss=hard_sample", ratios={"hard_sample_vs_ce": Ratio("ce", target=0.97)}),
    # a distillation from a teacher of the model's own size and weights: what the second model costs in time and memory
    training("distill", "loss=distill", *TEACHER_IS_THE_MODEL, on_request=True,
             ratios={"distill_vs_ce": Ratio("ce", memory=True)}),
    # the same teacher's top 64 logits a token from a cache the case writes first (untimed): no teacher held or run
    training("distill_cached", "loss=distill", *TEACHER_IS_THE_MODEL, f"loss.teacher_cache={CACHE_IN_SCRATCH}",
             on_request=True, ratios={"cached_vs_live_teacher": Ratio("distill", memory=True),
                                      "distill_cached_vs_ce": Ratio("ce", memory=True)}),
    training("packing", *PACKED, ratios={"packing_gain": Ratio("ce", target=1.3),
                                         "packing_vs_trl_padding_free": Ratio("trl_padding_free", target=1.3,
                                                                              memory=True),
                                         "packing_vs_trl_best": Ratio("trl_best", target=1.3, memory=True),
                                         "packing_vs_hf_padding_free": Ratio("hf_padding_free"),
                                         "torch_varlen_gain": Ratio("packing_slots"),
                                         "mfu_packing": Ratio(target=0.40)}),
    training("ce_spread", "loss=ce", spread=True),
    training("packing_spread", *PACKED, spread=True, ratios={"packing_gain_spread": Ratio("ce_spread", target=1.3)}),
    training("trl", "loss=ce", needs=("trl",)),
    training("trl_padding_free", "loss=ce", "model.attn_implementation=sdpa_varlen", needs=("trl",),
             ratios={"varlen_vs_mask_kernel": Ratio("trl_padding_free_mask", memory=True)}),
    training("trl_padding_free_mask", "loss=ce", needs=("trl",)),
    # FlexAttention has no backward on a CPU (torch 2.13)
    training("packing_flex", *PACKED, "model.attn_implementation=flex_attention", needs=("gpu",), on_request=True,
             ratios={"flex_vs_varlen": Ratio("packing")}),
    training("packing_pure", *PACKED, "trainer.bf16=true", "trainer.precision=pure", needs=("bf16",), on_request=True,
             ratios={"packing_pure_vs_mixed": Ratio("packing")}),
    training("packing_compiled", *PACKED, "trainer.compile_layers=true", on_request=True,
             ratios={"compile_layers_gain": Ratio("packing")}),
    training("packing_liger", *PACKED, "trainer.use_liger_kernel=true", needs=("liger",), on_request=True,
             ratios={"liger_layers_gain": Ratio("packing")}),
    training("packing_flash", *PACKED, "model.attn_implementation=flash_attention_2", needs=("flash",),
             on_request=True, ratios={"flash_vs_varlen": Ratio("packing")}),
    # packing's own attention without PyTorch's varlen kernel (the samples in padded slots, as on a CPU): what the
    # kernel gains on a GPU (`packing` over it)
    training("packing_slots", *PACKED, "model.attn_implementation=sdpa_slots", needs=("gpu",), on_request=True),
    training("trl_best", "loss=ce", "data.packing=false", needs=("trl",), on_request=True),
    training("hf_padding_free", "loss=ce", "data.packing=false", on_request=True),
    # a full fine-tune in pure bf16, of `bench.full_model` where set (preset=gpu_7b: Qwen2.5-1.5B's shape)
    training("packing_full", *PACKED, "lora=none", "model.dtype=float32", "trainer.bf16=true", "trainer.precision=pure",
             needs=("bf16",), on_request=True, full_model=True, ratios={"mfu_packing_full": Ratio(target=0.40)}),
    # `Trainer.evaluate()` on the eval rows: a plain Trainer's, this project's
    Case("eval_hf", EVAL, run=run_eval_case, overrides=("loss=ce", "trainer.report_to=[]", "trainer.disable_tqdm=true"),
         inline=True, show=show_eval),
    Case("eval_sft", EVAL, run=run_eval_case, overrides=("loss=ce", "trainer.report_to=[]", "trainer.disable_tqdm=true"),
         inline=True, show=show_eval,
         ratios={"eval_vs_hf_time": Ratio("eval_hf", "seconds_per_1000_rows")}),
    # the loss alone; `loss_lean` is whichever kernel `loss.impl=auto` picks here, the others each by name
    loss_kernel("loss_naive", "naive"),
    loss_kernel("loss_lean", "auto", ratios=versus_naive_loss("lean", target_memory=0.3, target_time=1.3)),
    loss_kernel("loss_chunked", "chunked", on_request=True,
                ratios=versus_naive_loss("chunked", when=kernel_ran("chunked"))),
    loss_kernel("loss_cce", "cce", on_request=True, ratios=versus_naive_loss("cce", when=kernel_ran("cce"))),
    loss_kernel("loss_liger", "liger", on_request=True, ratios=versus_naive_loss("liger", when=kernel_ran("liger"))),
    # the machine's matrix-product rate at the model's shapes, in the model's dtype and in bf16: the limit of the
    # training cases that train in that dtype (`sft.bench.report.hardware_ratios`)
    Case("matmul", MATMUL, run=run_matmul_case, show=show_matmul),
    Case("matmul_bf16", MATMUL, run=run_matmul_case, overrides=("model.dtype=bfloat16",), needs=("bf16",),
         show=show_matmul),
    Case("preprocess", ONCE, run=run_preprocess_case, drive=drive_preprocess, show=show_preprocess,
         ratios={"preprocess_cached_speedup": Ratio(target=10.0)}),
    Case("tokenize", ONCE, run=run_tokenize_case, drive=drive_tokenize, show=show_tokenize,
         ratios={"tokenize_vs_tokenizer": Ratio(target=0.9), "tokenize_vs_encode": Ratio(),
                 "tokenize_vs_baseline": Ratio()}),
    Case("scale", ONCE, run=run_scale_case, drive=drive_scale, show=show_scale,
         ratios={"scale_peak_rss_gb": Ratio(target=4.0, at_most=True),
                 "scale_cached_load_s": Ratio(target=10.0, at_most=True)}),
    Case("startup", ONCE, drive=drive_startup,
         ratios={"startup_cfg_job_s": Ratio(target=1.0, at_most=True), "startup_help_s": Ratio(target=1.0, at_most=True),
                 "startup_help_group_s": Ratio(target=1.0, at_most=True),
                 "startup_first_step_s": Ratio(target=5.0, at_most=True)}),
    # on request: a 15 GB checkpoint; rows of up to 16k tokens; streams of millions of rows; two processes under FSDP2
    Case("checksums", ONCE, run=run_checksums_case, drive=drive_checksums, show=show_checksums, on_request=True,
         ratios={"checksum_cached_gb_per_s": Ratio(), "checksum_disk_gb_per_s": Ratio()}),
    Case("long_rows", ONCE, run=run_long_rows_case, drive=drive_long_rows, show=show_long_rows, on_request=True,
         inline=True),
    Case("stream", ONCE, run=run_stream_case, drive=drive_stream, show=show_stream, on_request=True,
         ratios={"stream_peak_rss_ratio": Ratio(target=1.2, at_most=True), "stream_sequences_per_second": Ratio()}),
    Case("checkpoint_memory", ONCE, drive=drive_checkpoint_memory, show=show_checkpoint_memory, on_request=True,
         ratios={"checkpoint_rank0_vs_share": Ratio(target=1.0, at_most=True),
                 "checkpoint_rank0_gathered_mib": Ratio(), "checkpoint_rank0_sharded_mib": Ratio()}),
)
CASES = {case.name: case for case in TABLE}
assert len(CASES) == len(TABLE), "two cases of one name"
assert all(r.versus in CASES for case in TABLE for r in case.ratios.values() if r.versus), "a ratio against no case"


def default_cases() -> list[str]:
    """What `bench.cases` runs unless told: every case but those run only on request, in the table's order."""
    return [case.name for case in CASES.values() if not case.on_request]


def target_of(key: str) -> tuple[float, str] | None:
    """A ratio's target as (value, "min" | "max"); one measured at another batch size (`_b16`) has its base ratio's."""
    base = key.rsplit("_b", 1)[0] if key.rsplit("_b", 1)[-1].isdigit() else key
    for case in CASES.values():
        ratio = case.ratios.get(base)
        if ratio is not None and ratio.target is not None:
            return ratio.target, "max" if ratio.at_most else "min"
    return None
