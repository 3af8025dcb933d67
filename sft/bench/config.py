"""The `bench` node (`sft/conf/bench.yaml`): which cases `python -m sft.bench` runs, how long, the loss-only case's
shape. Training ignores it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

from sft.bench.cases import CASES, default_cases
from sft.bench.long_rows import LONG_ROW_VARIANTS
from sft.config import registry
from sft.config.schema import Schema, knob


@dataclass
class BenchConfig(Schema):
    """`python -m sft.bench`: which cases, how long, the loss-only case's shape."""

    cases: List[str] = knob(help="the cases to run (sft.bench.cases: hf, ce, ... startup; a case run only on request "
                            "runs when named here)", factory=default_cases)
    batch_sizes: Optional[List[int]] = knob(None, "the training cases run at each micro-batch size (null: "
                                            "trainer.per_device_train_batch_size); ratios at the first are named "
                                            "plainly (ce_vs_hf), at the others with the size (ce_vs_hf_b16)")
    steps: int = knob(40, "optimizer steps per training case")
    train_rows: Optional[str] = knob(None, "the training cases' rows: null, the data config's (data.train_file); "
                                     "multi_turn, chats of a system turn and two additions worked column by column, "
                                     "about 300 tokens each (sft.bench.rows.multi_turn_rows); realistic, chats of 100 "
                                     "to 4,000 tokens with the length spread of a published SFT set "
                                     "(sft.bench.rows.realistic_rows)")
    train_row_count: int = knob(512, "how many multi_turn or realistic rows")
    matmul_tokens: int = knob(1024, "matmul: the rows of each timed product (a micro-batch's tokens)")
    warmup_steps: int = knob(5, "steps not timed")
    profile_steps: int = knob(0, "steps profiled after the timed ones in each training case (raw aside): where a "
                              "step's time goes, by category (sft.bench.profile); 0: none")
    repeats: int = knob(3, "rounds over all cases, interleaved; each ratio is the median of its per-round ratios")
    threads: Optional[int] = knob(None, "torch threads of every case on a CPU (null: one per core)")
    min_cpu_share: float = knob(0.8, "a round in which a training case got less of its threads' wall time as CPU "
                                "time is loaded (other work took cores): flagged, and run again")
    reruns: int = knob(2, "how many times loaded rounds are run again, at most")
    startup_repeats: int = knob(5, "runs of each start-up command (the median counts)")
    loss_vocab: int = knob(151936, "the loss-only case's vocabulary (Qwen2.5's)")
    loss_hidden: int = knob(896, "the loss-only case's hidden size (Qwen2.5-0.5B's)")
    loss_batch: int = knob(4, "the loss-only case's rows")
    loss_seq: int = knob(1024, "the loss-only case's sequence length")
    loss_dtype: str = knob("float32", "the loss-only case's dtype")
    loss_trainable_head: bool = knob(False, "false: the projection frozen, as with LoRA")
    preprocess_rows: int = knob(100000, "rows tokenised cold, then loaded cached (preprocess)")
    tokenize_rows: int = knob(4000, "multi-turn rows tokenised side by side by sft and its 0.1 baseline (tokenize)")
    scale_rows: int = knob(1000000, "multi-turn rows (about 300 tokens) preprocessed cold, then loaded cached "
                           "(scale)")
    scale_processes: Optional[List[int]] = knob(None, "scale: also preprocess the rows cold with each of these "
                                                "numbers of processes (data.num_proc), rows/s each: how preparation "
                                                "scales with cores; null: only on every core")
    stream_rows: List[int] = knob(help="stream: the sizes of the files streamed, in rows (each read as far as "
                                  "stream_read)", factory=lambda: [50000, 5000000])
    stream_read: int = knob(500000, "stream: the training sequences read from each file, at most (a file of fewer is "
                            "read whole)")
    eval_repeats: int = knob(3, "evaluations timed per eval case (the best counts), after one untimed")
    checksum_gb: float = knob(15.0, "the checkpoint the checksums case writes and checksums (a 7B model's bf16 "
                              "weights: 15 GB)")
    checksum_dir: Optional[str] = knob(None, "where it writes it (null: the system's temporary dir)")
    long_row_lengths: List[int] = knob(help="long_rows: the packed row lengths trained, in tokens",
                                       factory=lambda: [1024, 4096, 16384])
    long_row_steps: int = knob(3, "long_rows: timed optimizer steps per length and variant (after one untimed)")
    long_row_tile_tokens: int = knob(512, "long_rows: model.tiled_mlp_tokens of its tiled variant")
    long_row_variants: List[str] = knob(help="long_rows: the variants run (offloaded: with a GPU; sequence_parallel: "
                                        "2 processes, on a CPU or 2 GPUs)",
                                        factory=lambda: list(LONG_ROW_VARIANTS))
    full_model: Optional[str] = knob(None, "packing_full: the model config it fully fine-tunes (a name of the model "
                                     "group, e.g. qwen2_5_1_5b_random); null: the run's model")
    case_timeout_s: int = knob(1800, "a case running longer is stopped (SIGTERM, then SIGKILL) and reported failed; the "
                               "others run on")
    case_timeouts: Dict[str, int] = knob(help="a case's own limit, in seconds, in place of case_timeout_s "
                                         "(+bench.case_timeouts.packing=600)", factory=dict)
    case_logs: Optional[str] = knob(None, "a dir each case process's output is written to as it runs "
                                    "(<case>-<n>.log); null: kept only to say why a case failed")
    isolate: bool = knob(True, "each training, eval and long_rows case in a fresh process, so that its peak memory is "
                         "its own; false: all in this one (faster, a quick check of the cases; memory not per case)")

    def check(self, cfg=None):
        unknown = [case for case in [*self.cases, *self.case_timeouts] if case not in CASES]
        self.require("case_timeouts", all(s >= 1 for s in self.case_timeouts.values()), "each must be >= 1 s")
        self.require("case_timeout_s", self.case_timeout_s >= 1, "must be >= 1 s")
        self.require("long_row_lengths", all(n >= 16 for n in self.long_row_lengths), "each must be >= 16 tokens")
        self.require("long_row_steps", self.long_row_steps >= 1, "must be >= 1")
        self.require("train_rows", self.train_rows in (None, "multi_turn", "realistic"),
                     "must be null, multi_turn or realistic")
        self.require("train_row_count", self.train_row_count >= 1, "must be >= 1")
        self.require("matmul_tokens", self.matmul_tokens >= 1, "must be >= 1")
        self.require("profile_steps", self.profile_steps >= 0, "must be >= 0")
        self.require("long_row_variants", set(self.long_row_variants) <= set(LONG_ROW_VARIANTS),
                     f"each must be one of {', '.join(LONG_ROW_VARIANTS)}")
        self.require("cases", not unknown, f"no such case: {', '.join(unknown)} (cases: {', '.join(CASES)})")


def compose(overrides: list[str]):
    """The training config with the bench's overrides (`sft/conf/bench.yaml`), as `python -m sft.train` would compose
    it, plus the `bench` node."""
    register()
    return registry.compose("bench", overrides)


def register() -> None:
    """The training config's schemas, and the `bench` node's (`bench_schema`, which only sft/conf/bench.yaml uses)."""
    from hydra.core.config_store import ConfigStore

    registry.register()
    ConfigStore.instance().store(name="bench_schema", node=BenchConfig, package="bench")
