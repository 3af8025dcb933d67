"""`python -m sft.bench [--out bench.json] [overrides]`: what this project's extra control costs, and what it gains.

Trains the same model on the same rows in the same order for `bench.steps` optimizer steps as
- `raw`: a hand-written PyTorch loop on sft's own batches (the model's logits, the assistant tokens' cross
  entropy, clipping, AdamW, the same schedule): the limit no framework can beat by much;
- `hf`: a plain `transformers.Trainer` with `DataCollatorForSeq2Seq` and the model's own loss;
- `ce_naive`: this project (`sft.run.build`, guard and clip policy included) computing the same full logits and
  cross entropy as `raw` and `hf` (`loss.impl=naive`): the framework's own cost;
- `ce`, `hard_sample`: this project with the lean loss `loss.impl=auto` picks (chunked on a CPU: only the
  assistant tokens are projected), and with the difficulty weights;
- `ce_bf16`: `ce` under bf16 autocast (`trainer.bf16=true`: fp32 weights cast to bf16 in every forward);
  `ce_bf16_pure`: the linear weights held in bf16 over the optimizer's fp32 copies (`trainer.precision=pure`); both
  on a CPU with bf16 instructions or a GPU, else skipped with one line; `ce_lora`: `ce` with `lora=default`
  (`ce_lora_naive`: with `loss.impl=naive`); `ce_compiled`: `ce` under torch.compile (on request: minutes);
- `packing`: `ce` with `data.packing=true` (the sdpa_varlen kernel); `ce_spread` and `packing_spread`: both on chats
  of a published dataset's length spread (LLaMA-Factory's alpaca_en_demo: 47 to 750 tokens, `sft.bench.rows`);
- `packing_flex`: `packing` on FlexAttention with the packed samples' document mask (`flex_attention`; on a GPU
  only, else skipped with one line); `packing_pure`: `packing` with `trainer.bf16=true trainer.precision=pure`
  (with `preset=gpu_7b`'s LoRA: the frozen base in bf16 only); `packing_compiled`: `packing` with each decoder layer
  compiled (`trainer.compile_layers=true`; on request); `packing_liger`: with Liger's RMSNorm, RoPE and SwiGLU
  (`trainer.use_liger_kernel=true`; on a GPU with liger-kernel, else skipped with one line; on request);
  `packing_flash`: on flash attention 2's varlen kernel (on a GPU with flash-attn, else skipped with one line; on
  request);
- `trl`, `trl_padding_free`, `trl_padding_free_mask`: TRL's `SFTTrainer` padded, padding-free on the same
  sdpa_varlen kernel as `packing`, and padding-free on its own kernel (a block-diagonal mask), all on `sft`'s own
  tokenised rows and labels with the model's own loss (tested: the same step losses as `sft` with `loss=ce`);
  skipped with one line when TRL is not installed (`pip install -e '.[bench]'`); `trl_best` and `hf_padding_free`
  (on request: the GPU pack's): TRL's SFTTrainer and a plain Trainer each at its own fastest documented settings
  (padding-free batches, TRL's or transformers' `DataCollatorWithFlattening`; `use_liger_kernel` on a GPU with
  liger-kernel; flash attention 2 where flash-attn is installed, else sdpa with the per-sample mask transformers reads
  from the position ids; the model's own loss; no activation checkpointing), tested to log sft's step losses;
- `packing_full` (on request): `packing` as a full fine-tune in pure bf16, of `bench.full_model` where set
  (`preset=gpu_7b`: Qwen2.5-1.5B's shape);
each at every micro-batch size of `bench.batch_sizes` (64, then the training default of 16: `ce_b16` ...);
times `Trainer.evaluate()` on the eval rows, a plain Trainer's (`eval_hf`) against this project's
(`eval_sft`), per 1,000 rows; and times the loss alone, forward and backward, on `bench.loss_batch x
bench.loss_seq` tokens at `bench.loss_vocab x bench.loss_hidden` (Qwen2.5's vocabulary): `loss_naive` (the
full logits, then the cross entropy) and `loss_lean` (the kernel training picks: Liger's on a GPU where installed,
chunked on a CPU); `loss_chunked`, `loss_cce`, `loss_liger` (on request) each kernel by name.

The ratios say what they measure: `sft_vs_raw` and `overhead_vs_hf` (the same loss computation on both sides),
`lean_loss_gain` (`ce` over `ce_naive`; `lean_loss_gain_lora` the same with LoRA), `hard_sample_vs_ce`,
`bf16_vs_fp32` (`ce_bf16_pure` over `ce`; `bf16_mixed_vs_fp32`: `ce_bf16` over `ce`; `pure_vs_mixed`),
`lora_vs_full` (`ce_lora` over `ce`), `compile_gain` (`ce_compiled` over `ce`), `packing_gain` (`packing` over
`ce`), `packing_gain_spread` (the same on the spread), `ce_vs_trl`, `packing_vs_trl_padding_free` (the same kernel)
and, apart, `varlen_vs_mask_kernel` (TRL padding-free on the two kernels), `flex_vs_varlen` (`packing_flex` over
`packing`), `packing_pure_vs_mixed` (`packing_pure` over `packing`), `compile_layers_gain` (`packing_compiled` over
`packing`), `liger_layers_gain` (`packing_liger` over `packing`), `flash_vs_varlen` (`packing_flash` over
`packing`), `packing_vs_trl_best` and
`packing_vs_hf_padding_free` (sft's packed run over each trainer at its fastest), and where the GPU's peak is known
`mfu_packing` and `mfu_packing_full` (executed FLOPs; `mfu_6n_<case>`, the 6N convention's). Each case runs in a
fresh process with the same torch threads (`bench.threads`) and, on a CPU, the same
allocator settings (`sft.training.processes.distributed.reuse_freed_memory`), so peak memory is its own (on a CPU: the
whole process's peak resident memory, imports and data included). The rounds interleave the cases, every other round in
reverse order, and repeat `bench.repeats` times; a ratio is the median of its per-round ratios, with their spread. Each
round records the load average, wall and CPU time; a round in which a training case got less than `bench.min_cpu_share`
of its threads' time is loaded: flagged and run again (`bench.reruns`). Training cases are timed from the end of step
`bench.warmup_steps` to the last step: input tokens (padding excluded) per second.

Also: `preprocess`, tokenising `bench.preprocess_rows` rows into a fresh cache and then loading them
from it; `tokenize`, the same `bench.tokenize_rows` multi-turn rows (about 300 tokens each) tokenised in
one process by `sft.data.tokens.labels.tokenize_batch`, by sft 0.1's (`sft.bench.baseline`) and by the tokenizer's own
`apply_chat_template(tokenize=True)` (the target: `tokenize_vs_tokenizer`), interleaved, one core each, beside the
tokenizer alone on the texts rendered beforehand; `scale`, preprocessing `bench.scale_rows` such rows into a fresh
cache on every core (rows/s, the peak resident memory of the process and of its largest worker), then loading them
from the cache, and with each of `bench.scale_processes` processes; `startup`, the median wall time of
`python -m sft.train --cfg job`, `--help` and `--help loss loss=focal`, and of the default run from the command to
its first optimizer step (`startup_first_step_s`, warm caches); `checksums` (only when named), a 15 GB
checkpoint's CRC-32s from the page cache and from the disk; `stream` (only when named), `bench.stream_read` sequences
read as `data.streaming=true` reads them from files of each of `bench.stream_rows` rows (the target: the peak memory
with the largest file within 1.2x the smallest's); `checkpoint_memory` (only when named), each rank's peak
memory while a 2-process FSDP2 full fine-tune saves a checkpoint, gathered and sharded (`sft.bench.checkpoint_memory`;
the target: rank 0's, sharded, within its share of the checkpoint); `long_rows` (only when named), one row a step of
each of `bench.long_row_lengths` tokens, plain, checkpointed, with tiled MLPs, (GPU) offloaded checkpoints and
each row split over 2 processes (`sp=ulysses`): tokens/s and memory per token (docs/long_context.md).

`matmul` times `torch.mm` over the model's own linear layers' shapes (`bench.matmul_tokens` rows each, the same
threads) in the model's dtype, `matmul_bf16` in bf16: the rate a step made of nothing but its matrix products would
reach here. Each round reads it anew; the limit is the best reading of the run (the machine's rate moves between
rounds: its spread is reported). Each training case is held to the limit of the dtype it trains in:
`hw_exec_<case>`, the FLOP/s of the products its step executes (`sft.training.observability.throughput.flops_per_token`:
the output layer only at the positions whose logits are computed, LoRA's own products, frozen weights without their
gradient) over the limit, and `hw_model_<case>`, the MFU convention's 6N per token plus attention over the same limit
(`model_flops_per_token`): the CPU's analogues of MFU, measured rather than taken from a data sheet.
`bench.train_rows=multi_turn` trains every case on chats of about 300 tokens.

`preset=smollm2` runs the training cases on the real model (SmolLM2-135M-Instruct) on such chats, with `matmul`
and `matmul_bf16`. `preset=qwen_vocab` trains `packing` and `trl_padding_free` with Qwen2.5's 151,936-token
vocabulary on the tiny model's body, where the output layer weighs as in real fine-tuning. `preset=gpu_7b` is the GPU
check: LoRA on a randomly initialised model of Qwen2.5-7B's shape, bf16, packed rows of about 4k tokens, the lean
loss, beside TRL and a plain Trainer at their fastest and a full fine-tune of Qwen2.5-1.5B's shape (see
sft/conf/preset/gpu_7b.yaml). While it runs, the results so far stand in `<out>.partial` (after each case): a run
stopped by a time limit keeps what it measured (`sft.bench.report.read_partial`).

The overrides are the training config's (`loss.impl=naive`, `trainer.per_device_train_batch_size=8`,
`model=...`), plus `bench.*`. Prints a table and writes the raw numbers and ratios to `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from omegaconf import OmegaConf

from sft.bench.cases import CASES, ONCE, TRAINING, Case, Context
from sft.bench.config import compose
from sft.bench.device import missing, on_gpu, threads
from sft.bench.report import case_id, judge_targets, print_report, round_figures, write_partial
from sft.bench.rows import multi_turn_rows, realistic_rows, spread_rows
from sft.bench.training import timed_training_overrides
from sft.config.schema import ConfigError
from sft.config.validate import check

RESULT = "BENCH_RESULT "  # how a case's process prints its result: this, then one JSON line


# --- a case's process ----------------------------------------------------------------------------------------------


RUNNING: dict = {}  # the case process running now: a SIGTERM to the bench stops it too (`stop_running_case`)
GRACE_S = 5  # a case out of time: SIGTERM, this long to end, then SIGKILL


def spawn(case: str, cfg, env: dict | None = None, processes: int = 1) -> dict:
    """Run one case in a fresh process (the same threads for every case), or in `processes` of them under torchrun
    (the cores shared out); its result, or why it failed. `bench.isolate=false` runs an `inline` case in this one.
    Its output goes to `bench.case_logs`/<case>-<n>.log as it runs (where set); past its limit (`bench.case_timeouts`,
    else `bench.case_timeout_s`) it and every process it started get SIGTERM, then SIGKILL, and it fails saying so."""
    if not cfg.bench.isolate and processes == 1 and CASES[case].inline:
        return json.loads(json.dumps(run_case(case, cfg)))  # in this process (as JSON, like a child's result)
    env = {"OMP_NUM_THREADS": str(max(1, threads(cfg) // processes)), **(env or {})}  # (the children share them too)
    launcher = [] if processes == 1 else ["-m", "torch.distributed.run", f"--nproc_per_node={processes}",
                                          f"--master_port={free_port()}"]
    limit = int((cfg.bench.case_timeouts or {}).get(case, cfg.bench.case_timeout_s))
    with tempfile.TemporaryDirectory(prefix=f"sft-bench-{case}-") as tmp:
        config = Path(tmp, "config.yaml")
        config.write_text(OmegaConf.to_yaml(cfg))
        log = case_log(cfg.bench.case_logs, case) or Path(tmp, "case.log")
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, *launcher, "-m", "sft.bench", "--case", case, "--config",
                                     str(config)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **env})
            RUNNING["case"] = proc
            try:
                code, expired = proc.wait(timeout=limit), False
            except subprocess.TimeoutExpired:
                code, expired = stop(proc), True
            finally:
                RUNNING.pop("case", None)
        text = log.read_text(errors="replace")
    for line in text.splitlines():
        if line.startswith(RESULT) and not expired:
            return json.loads(line[len(RESULT):])
    tail = "\n".join(text.strip().splitlines()[-15:])
    if expired:
        raise RuntimeError(f"bench case {case} ran out of its {limit} s (stopped with SIGTERM, then SIGKILL):\n{tail}")
    raise RuntimeError(f"bench case {case} failed (exit {code}):\n{tail}")


def case_log(folder: str | None, case: str) -> Path | None:
    """Where a case's output goes (`bench.case_logs`: `<case>-<n>.log`, n its run's number), or None."""
    if folder is None:
        return None
    Path(folder).mkdir(parents=True, exist_ok=True)
    n = 1 + sum(1 for _ in Path(folder).glob(f"{case}-*.log"))
    return Path(folder, f"{case}-{n}.log")


def stop(proc: subprocess.Popen, grace_s: float = GRACE_S) -> int:
    """End a case's process group: SIGTERM, then SIGKILL once `grace_s` have passed; its exit code."""
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def stop_running_case(signum, frame) -> None:
    """The bench's SIGTERM (a time limit on the bench itself, `sft gpu-pack`): the case running now is stopped with it;
    every case finished stands in the partial results, written after each."""
    if (proc := RUNNING.get("case")) is not None:
        stop(proc)
    raise SystemExit(128 + signum)


def free_port() -> int:
    """A TCP port nothing listens on now (torchrun's rendezvous for a case in several processes)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def child(case: str, config_file: str) -> None:
    """Entry of a case's process: run it, print its result as one JSON line."""
    import logging

    from sft.bench import config as bench_config
    from sft.ranks import is_rank_zero

    logging.basicConfig(level=logging.WARNING)
    bench_config.register()
    result = run_case(case, OmegaConf.load(config_file))
    if is_rank_zero():  # several processes (long_rows' sequence parallelism): rank 0 reports
        print(RESULT + json.dumps(result), flush=True)


def run_case(case: str, cfg) -> dict:
    """Run one case's function in this process (the same torch threads for every case on a CPU); its result."""
    if not on_gpu():  # every case the same threads (launch.sh's runs: one per core) and allocator (as sft's runs)
        import torch

        from sft.training.processes.distributed import reuse_freed_memory

        torch.set_num_threads(threads(cfg))
        reuse_freed_memory()
    return CASES[case].run(case, cfg)


# --- the driver ----------------------------------------------------------------------------------------------------


def available(names: list[str], report: dict) -> list[Case]:
    """The cases of `names` this machine can run; each other one skipped, said in one line per reason."""
    wanted, skipped = [], {}
    for name in names:
        case = CASES[name]
        reason = next((why for need in case.needs if (why := missing(need))), None)
        if reason:
            skipped.setdefault(reason, []).append(name)
            report["skipped"][name] = reason
        else:
            wanted.append(case)
    for reason, cases in skipped.items():
        print(f"skipping {', '.join(cases)}: {reason}", file=sys.stderr)
    return wanted


def jobs_of(case: Case, overrides: list[str], base, sizes: list[int], rows: dict[str, list[str]]) -> dict:
    """What the rounds run for `case`: {its id: (its name, its config)}. A training case trains the timed steps at
    each batch size of `sizes` on its rows (`rows`: the spread's, or the run's); the others run once with their
    overrides."""
    if case.kind != TRAINING:
        return {case.name: (case.name, compose(overrides + list(case.overrides)) if case.overrides else base)}
    b = base.bench
    model = [f"model={b.full_model}"] if case.full_model and b.full_model else []
    return {case_id(case.name, size, sizes[0]): (case.name, compose(
        overrides + rows["spread" if case.spread else "run"] + model + list(case.overrides)
        + timed_training_overrides(base) + [f"trainer.per_device_train_batch_size={size}"])) for size in sizes}


def run_rounds(jobs: dict, b, report: dict, partial: Path | None = None) -> list[dict]:
    """`b.repeats` rounds over every job, in turn (every other round in reverse order); each round's load average
    and, on a CPU, the least CPU share a training case got (`report["rounds"]`). A loaded round (a share below
    `b.min_cpu_share`) is run again, at most `b.reruns` times, and kept flagged if it stays loaded. After each case,
    every result so far is written to `partial` (a run stopped by a time limit keeps what it measured)."""
    rounds = []
    report.setdefault("failed", {})
    for number in range(1, b.repeats + 1):
        for attempt in range(b.reruns + 1):
            load = os.getloadavg()[0]
            results = {}
            # every other round in reverse order: a machine that speeds up or slows down over a round (it does,
            # here) then favours no case; a ratio's paired rounds see each of its cases first as often
            order = list(jobs.items()) if number % 2 else list(jobs.items())[::-1]
            for name, (case, cfg) in order:
                if name in report["failed"]:
                    continue
                print(f"[round {number}/{b.repeats}] {name} ...", file=sys.stderr, flush=True)
                try:
                    results[name] = spawn(case, cfg)
                except RuntimeError as e:  # one case's fault (a kernel that fails here): said; the others run on
                    report["failed"][name] = str(e)
                    print(f"[round {number}/{b.repeats}] {name} failed: {e}", file=sys.stderr, flush=True)
                if partial is not None:
                    write_partial(partial, report, rounds + [results])
            shares = [r["cpu_share"] for r in results.values() if "cpu_share" in r]
            info = {"round": number, "attempt": attempt + 1, "load_before": load, "load_after": os.getloadavg()[0],
                    "min_cpu_share": min(shares) if shares else None,
                    "loaded": bool(shares) and min(shares) < b.min_cpu_share}
            if not info["loaded"] or attempt == b.reruns:
                break
            print(f"[round {number}/{b.repeats}] loaded: a training case got {min(shares):.0%} of its threads' time "
                  "(other work took cores); running the round again", file=sys.stderr, flush=True)
        rounds.append(results)
        report["rounds"].append(info)
    for results in rounds:  # a case that failed in any round is in none: its figures are not comparable
        for name in report["failed"]:
            results.pop(name, None)
    return rounds


def run_all(overrides: list[str], partial: Path | None = None) -> dict:
    """Every case of `bench.cases`: those of the rounds interleaved and repeated, then those run once; the raw
    numbers, medians and ratios (and, after each case of the rounds, the results so far in `partial`)."""
    base = compose(overrides)
    check(base)  # the bench's node and the training config it runs, as python -m sft.train checks them
    b = base.bench
    report: dict = {"overrides": overrides, "raw": {}, "cases": {}, "ratios": {}, "spread": {}, "rounds": [],
                    "skipped": {}, "failed": {}, "isolated": bool(base.bench.isolate)}
    wanted = available(list(b.cases), report)
    sizes = list(b.batch_sizes or [base.trainer.per_device_train_batch_size])
    report["names"] = [case.name for case in wanted]  # what the ratios are of, also for a stopped run's partial
    report["suffixes"] = [case_id("", size, sizes[0]) for size in sizes]
    with tempfile.TemporaryDirectory(prefix="sft-bench-rows-") as rows_dir:
        rows = {"run": [], "spread": []}
        if b.train_rows == "multi_turn":  # chats of about 300 tokens, as real fine-tuning data has them
            multi_turn_rows(path := Path(rows_dir, "multi_turn.jsonl"), b.train_row_count)
            rows["run"] = [f"data.train_file={path}"]
        elif b.train_rows == "realistic":  # 100 to 4,000 tokens, as users' chats (in the run's tokens)
            from hydra.utils import instantiate

            realistic_rows(path := Path(rows_dir, "realistic.jsonl"), b.train_row_count, instantiate(base.tokenizer))
            rows["run"] = [f"data.train_file={path}"]
        if any(case.spread for case in wanted):
            spread_rows(path := Path(rows_dir, "spread.jsonl"), b.train_row_count)
            rows["spread"] = [f"data.train_file={path}"]
        jobs = {}
        for case in wanted:
            if case.kind != ONCE:
                jobs.update(jobs_of(case, overrides, base, sizes, rows))
        rounds = run_rounds(jobs, b, report, partial) if jobs else []
    round_figures(report, rounds, report["names"], report["suffixes"])
    cases = report["cases"]
    context = Context(overrides, base, compose, spawn, free_port)
    for case in wanted:  # a driver's figure is one reading, or its rounds' (a list: the median, with their spread)
        if case.kind == ONCE:
            figures, ratios = case.drive(context)
            if figures:
                cases[case.name] = figures
            for key, value in ratios.items():
                report["ratios"][key] = statistics.median(value) if isinstance(value, list) else value
                if isinstance(value, list):
                    report["spread"][key] = [min(value), max(value)]
    judge_targets(report)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sft.bench", description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="bench.json", help="where to write the raw numbers and ratios")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    parser.add_argument("--config", help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.case:
        child(args.case, args.config)
        return 0
    from hydra.errors import HydraException

    from sft.config.argv import composition_error

    partial = Path(args.out + ".partial")  # the results so far, while it runs (`write_partial`)
    signal.signal(signal.SIGTERM, stop_running_case)
    try:
        report = run_all(overrides, partial)
    except ConfigError as e:
        print(f"error: config: {e}", file=sys.stderr)
        return 2
    except HydraException as e:  # an override that does not compose: one line, as python -m sft.train says it
        print(f"error: config: {composition_error(e, overrides, compose) or str(e).splitlines()[0]}",
              file=sys.stderr)
        return 2
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    partial.unlink(missing_ok=True)
    print_report(report)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
