"""The bench's data cases (`sft.bench.cases`): preprocessing into a cache and loading from it (`preprocess`),
tokenising side by side with sft 0.1 and the tokenizer's own chat path (`tokenize`), preprocessing at scale (`scale`),
reading a stream (`stream`), and a 7B checkpoint's checksums (`checksums`). Each is run once by its driver (`drive_*`),
which runs the case's function (`run_*_case`) in fresh processes (a cold cache, one core)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from sft.bench.rows import multi_turn_rows, synthetic_rows


def run_preprocess_case(case: str, cfg) -> dict:
    """Load `bench.preprocess_rows` rows with `sft.data.load.load_sft_datasets` (a cold or a warm cache)."""
    from hydra.utils import instantiate

    from sft.data.load import load_sft_datasets

    tokenizer = instantiate(cfg.tokenizer)
    started = time.perf_counter()
    data = load_sft_datasets(instantiate(cfg.data, _convert_="object"), tokenizer)
    return {"seconds": time.perf_counter() - started, "rows": len(data.train)}


def run_tokenize_case(case: str, cfg) -> dict:
    """`data.train_file`'s rows tokenised side by side in this process, `bench.repeats` interleaved rounds: by
    `sft.data.tokens.labels.tokenize_batch`, by sft 0.1's (`sft.bench.baseline`), both through `datasets.map` as preprocessing
    runs them, and by the tokenizer's own chat path through it too (`chat_template_batch`: one render and the encoding
    a chat, no labels); and by the tokenizer alone on the texts already rendered (`encode`). Also how many
    chat-template renders a row costs."""
    from datasets import Dataset, disable_progress_bars
    from hydra.utils import instantiate

    from sft.bench import baseline as bench_baseline
    from sft.data.chat.settings import chat_settings
    from sft.data.chat.template import ChatRenderer
    from sft.data.chat.turns import chat_views
    from sft.data.rows.reading import iter_jsonl
    from sft.data.spec import Labelling
    from sft.data.splits.preprocess import write_rows
    from sft.data.tokens import labels as sft_labels
    from sft.data.tokens.labels import encode, tokenize_batch

    disable_progress_bars()
    tokenizer = instantiate(cfg.tokenizer)
    # the same rows as each stores them: sft 0.1 a list of them (Dataset.from_list), sft in an Arrow file
    rows = Dataset.from_list(list(iter_jsonl(cfg.data.train_file, [])))
    with tempfile.TemporaryDirectory() as tmp:
        write_rows(iter_jsonl(cfg.data.train_file, []), Path(tmp, "rows.arrow"))
        stored = Dataset.from_file(str(Path(tmp, "rows.arrow")), in_memory=True)
    kwargs = {"baseline": {"tokenizer": tokenizer, "max_length": cfg.data.max_length},
              "sft": {"tokenizer": tokenizer, "labelling": Labelling(max_length=cfg.data.max_length)},
              "chat": {"tokenizer": tokenizer, "chat_kwargs": chat_settings(tokenizer).kwargs}}
    texts = [text for messages in rows["messages"] for text, _ in chat_views(tokenizer, messages)]
    seconds: dict[str, list[float]] = {"baseline": [], "sft": [], "chat": [], "tokenizer": []}
    for round_ in range(cfg.bench.repeats):
        for name, function, source in (("baseline", bench_baseline.tokenize_batch, rows),
                                       ("sft", tokenize_batch, stored), ("chat", chat_template_batch, rows)):
            started = time.perf_counter()
            source.map(function, batched=True, batch_size=256, remove_columns=["messages", "tools"],
                       fn_kwargs=kwargs[name], keep_in_memory=True, new_fingerprint=f"{name}-{round_}")
            seconds[name].append(time.perf_counter() - started)
        started = time.perf_counter()
        for i in range(0, len(texts), 256):
            encode(tokenizer, texts[i:i + 256])
        seconds["tokenizer"].append(time.perf_counter() - started)
    renders = {"baseline": 0, "sft": 0}
    plain, fast, views = tokenizer.apply_chat_template, ChatRenderer.__call__, sft_labels.chat_views
    labelling = [False]  # sft's renders a row: those of labelling a chat (not the template's probes, once a batch)
    try:
        def count(name, render):
            def counted(*args, **kw):
                renders[name] += name == "baseline" or labelling[0]
                return render(*args, **kw)
            return counted

        def counted_views(*args, **kw):
            labelling[0] = True
            try:
                return views(*args, **kw)
            finally:
                labelling[0] = False

        counted = rows[:100]
        tokenizer.apply_chat_template = count("baseline", plain)
        bench_baseline.tokenize_batch(counted, **kwargs["baseline"])
        ChatRenderer.__call__, sft_labels.chat_views = count("sft", fast), counted_views
        tokenize_batch(counted, **kwargs["sft"])
    finally:
        tokenizer.apply_chat_template, ChatRenderer.__call__, sft_labels.chat_views = plain, fast, views
    n = len(rows)
    return {"rows": n, **{f"{name}_rows_per_second": n / statistics.median(s) for name, s in seconds.items()},
            **{f"{name}_renders_per_row": count / len(counted["messages"]) for name, count in renders.items()},
            # each round's ratio of sft's rows/s to the others' (the bench's ratios are their medians)
            "round_ratios": {f"vs_{name}": [theirs / ours for theirs, ours in zip(seconds[name], seconds["sft"])]
                             for name in ("baseline", "chat", "tokenizer")}}


def chat_template_batch(batch: dict, tokenizer, chat_kwargs: dict) -> dict:
    """`datasets.map` function: each chat's ids as the tokenizer's own chat path makes them (one render of the
    template, then the encoding; no labels), the rows' absent fields (Arrow's nulls) left out as in the JSON."""
    chats = [[{k: v for k, v in m.items() if v is not None} for m in messages] for messages in batch["messages"]]
    return {"input_ids": tokenizer.apply_chat_template(chats, tokenize=True, **chat_kwargs)["input_ids"]}


def run_scale_case(case: str, cfg) -> dict:
    """Preprocess `data.train_file` (or load it from the cache): seconds and the peak resident memory of this
    process and of its largest worker (`datasets.map`'s processes)."""
    import resource

    result = run_preprocess_case(case, cfg)
    return {**result, "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "worker_peak_rss_gb": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20}


def run_stream_case(case: str, cfg) -> dict:
    """Read `bench.stream_read` training sequences of `data.train_file` as `data.streaming=true` reads them (validated,
    labelled, weighed: `sft.data.splits.streaming`), from the tokenizer's start: seconds and this process's peak resident
    memory, start-up (the sources identified, the eval rows) included."""
    import resource

    from hydra.utils import instantiate

    from sft.data.load import load_sft_datasets
    from sft.loss.base import build_loss

    started = time.perf_counter()
    tokenizer = instantiate(cfg.tokenizer)
    data = load_sft_datasets(instantiate(cfg.data, _convert_="object"), tokenizer, build_loss(cfg.loss))
    read = 0
    for _ in data.train:
        read += 1
        if read == cfg.bench.stream_read:
            break
    return {"sequences": read, "seconds": time.perf_counter() - started,
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def run_checksums_case(case: str, cfg) -> dict:
    """A checkpoint of `bench.checksum_gb` GB (four shards, as a 7B model's bf16 weights) written to a temporary
    dir beside `bench.checksum_dir`, then its manifest (every file's CRC-32, `sft.training.checkpoints.store.manifest`)
    timed twice: as at a save (the shards just written, in the page cache) and as at a resume after a restart
    (read from the disk: the page cache dropped first, where this process may; else reported as not measured)."""
    import os

    from sft.training.checkpoints.store import manifest

    shard = int(cfg.bench.checksum_gb * 1e9 / 4)
    with tempfile.TemporaryDirectory(prefix="sft-bench-checksums-", dir=cfg.bench.checksum_dir) as tmp:
        for i in range(4):
            with open(Path(tmp, f"model-{i + 1:05d}-of-00004.safetensors"), "wb") as f:
                for _ in range(0, shard, 1 << 26):
                    f.write(os.urandom(min(1 << 26, shard)))
                f.truncate(shard)
        started = time.perf_counter()
        manifest(Path(tmp))
        cached = time.perf_counter() - started
        try:
            os.sync()
            Path("/proc/sys/vm/drop_caches").write_text("3")
        except OSError:
            return {"gb": 4 * shard / 1e9, "cached_s": cached, "disk_s": None}
        started = time.perf_counter()
        manifest(Path(tmp))
        return {"gb": 4 * shard / 1e9, "cached_s": cached, "disk_s": time.perf_counter() - started}


# --- run once by the driver (`Case.drive`): each spawns the case's function above in fresh processes --------------

MULTI_TURN = ["data.eval_file=null", "data.max_length=1024"]  # the multi-turn rows' cases: about 300 tokens a row


def drive_preprocess(context) -> tuple[dict, dict]:
    """`bench.preprocess_rows` rows tokenised into a fresh cache, then loaded from it."""
    b, compose, overrides = context.base.bench, context.compose, context.overrides
    with tempfile.TemporaryDirectory(prefix="sft-bench-preprocess-") as tmp:
        env = {"SFT_CACHE": str(Path(tmp, "cache"))}  # cold: nothing cached yet
        few, rows = Path(tmp, "few.jsonl"), Path(tmp, "rows.jsonl")
        synthetic_rows(few, 10)
        synthetic_rows(rows, b.preprocess_rows)
        # Untimed: builds the tiny model (the tokenizer) into the fresh cache, on 10 rows.
        context.spawn("preprocess", compose(overrides + [f"data.train_file={few}", "data.eval_file=null"]), env)
        cfg = compose(overrides + [f"data.train_file={rows}", "data.eval_file=null"])
        cold = context.spawn("preprocess", cfg, env)
        warm = context.spawn("preprocess", cfg, env)
    return ({"rows": cold["rows"], "first_s": cold["seconds"], "cached_s": warm["seconds"]},
            {"preprocess_cached_speedup": cold["seconds"] / warm["seconds"]})


def drive_tokenize(context) -> tuple[dict, dict]:
    """`bench.tokenize_rows` multi-turn rows tokenised side by side in one process (`run_tokenize_case`); the ratios
    are the medians of its per-round ratios, with their spread (`<ratio>_spread`)."""
    with tempfile.TemporaryDirectory(prefix="sft-bench-tokenize-") as tmp:
        multi_turn_rows(rows := Path(tmp, "rows.jsonl"), context.base.bench.tokenize_rows)
        # one core each: the tokenizer's own threads would blur the per-row comparison
        tokenized = context.spawn("tokenize", context.compose(context.overrides + MULTI_TURN
                                                              + [f"data.train_file={rows}"]),
                                  {"TOKENIZERS_PARALLELISM": "false"})
    # sft's rows/s over: the tokenizer's own chat path (rendering and encoding, the least any labelling does: the
    # target), the encoding of texts rendered beforehand (no chat work at all), sft 0.1's labelling
    ratios = {ratio: tokenized["round_ratios"][versus] for ratio, versus in (
        ("tokenize_vs_tokenizer", "vs_chat"), ("tokenize_vs_encode", "vs_tokenizer"),
        ("tokenize_vs_baseline", "vs_baseline"))}
    return tokenized, ratios


def drive_scale(context) -> tuple[dict, dict]:
    """`bench.scale_rows` multi-turn rows preprocessed cold on every core, then loaded from the cache; and with each of
    `bench.scale_processes` processes, each into a fresh cache of its own."""
    b, compose, overrides, spawn = context.base.bench, context.compose, context.overrides, context.spawn
    ratios = {}
    with tempfile.TemporaryDirectory(prefix="sft-bench-scale-") as tmp:
        env = {"SFT_CACHE": str(Path(tmp, "cache"))}
        few, rows = Path(tmp, "few.jsonl"), Path(tmp, "rows.jsonl")
        multi_turn_rows(few, 10)
        multi_turn_rows(rows, b.scale_rows)
        spawn("preprocess", compose(overrides + MULTI_TURN + [f"data.train_file={few}"]), env)  # the tiny model
        cfg = compose(overrides + MULTI_TURN + [f"data.train_file={rows}"])
        cold = spawn("scale", cfg, env)
        warm = spawn("scale", cfg, env)
        for n in b.scale_processes or []:
            run = spawn("scale", compose(overrides + MULTI_TURN + [f"data.train_file={rows}", f"data.num_proc={n}"]),
                        {"SFT_CACHE": str(Path(tmp, f"cache-{n}"))})
            ratios[f"scale_rows_per_second_{n}p"] = b.scale_rows / run["seconds"]
    figures = {"rows": cold["rows"], "rows_per_second": b.scale_rows / cold["seconds"], "first_s": cold["seconds"],
               "peak_rss_gb": cold["peak_rss_gb"], "worker_peak_rss_gb": cold["worker_peak_rss_gb"],
               "cached_s": warm["seconds"], "cached_peak_rss_gb": warm["peak_rss_gb"]}
    ratios.update(scale_peak_rss_gb=max(cold["peak_rss_gb"], cold["worker_peak_rss_gb"]),
                  scale_cached_load_s=warm["seconds"])
    return figures, ratios


def drive_checksums(context) -> tuple[dict, dict]:
    """A 15 GB checkpoint's CRC-32s from the page cache and from the disk (`run_checksums_case`)."""
    figures = context.spawn("checksums", context.base)
    ratios = {"checksum_cached_gb_per_s": figures["gb"] / figures["cached_s"]}
    if figures["disk_s"] is not None:
        ratios["checksum_disk_gb_per_s"] = figures["gb"] / figures["disk_s"]
    return figures, ratios


def drive_stream(context) -> tuple[dict, dict]:
    """`bench.stream_read` sequences streamed from files of each of `bench.stream_rows` rows (`run_stream_case`)."""
    results = {}
    with tempfile.TemporaryDirectory(prefix="sft-bench-stream-") as tmp:
        for n in context.base.bench.stream_rows:
            synthetic_rows(rows := Path(tmp, f"rows-{n}.jsonl"), n)
            results[n] = context.spawn("stream", context.compose(context.overrides + [
                f"data.train_file={rows}", "data.eval_file=null", "data.streaming=true", "trainer.max_steps=1"]))
            rows.unlink()
    small, large = min(results), max(results)
    return ({str(n): r for n, r in results.items()},
            {"stream_peak_rss_ratio": results[large]["peak_rss_gb"] / results[small]["peak_rss_gb"],
             "stream_sequences_per_second": results[large]["sequences"] / results[large]["seconds"]})


# --- their lines in the printed report (`Case.show`) ---------------------------------------------------------------

def show_preprocess(name: str, report: dict) -> list[str]:
    p = report["cases"][name]
    return [f"preprocess    {p['rows']} rows: first {p['first_s']:.1f} s, cached {p['cached_s']:.2f} s"]


def show_tokenize(name: str, report: dict) -> list[str]:
    t = report["cases"][name]
    return [f"tokenize      {t['rows']} multi-turn rows, rows/s on one core: sft {t['sft_rows_per_second']:.0f} "
            f"({t['sft_renders_per_row']:g} renders a row), the tokenizer's apply_chat_template(tokenize=True) "
            f"{t['chat_rows_per_second']:.0f} (1 render, no labels), encoding the rendered texts alone "
            f"{t['tokenizer_rows_per_second']:.0f}, sft 0.1 {t['baseline_rows_per_second']:.0f} "
            f"({t['baseline_renders_per_row']:g} renders)"]


def show_scale(name: str, report: dict) -> list[str]:
    c = report["cases"][name]
    return [f"scale         {c['rows']} rows: {c['rows_per_second']:.0f} rows/s ({c['first_s']:.0f} s), peak RSS "
            f"{c['peak_rss_gb']:.2f} GiB (largest worker {c['worker_peak_rss_gb']:.2f} GiB); cached load "
            f"{c['cached_s']:.1f} s ({c['cached_peak_rss_gb']:.2f} GiB)"]


def show_checksums(name: str, report: dict) -> list[str]:
    c = report["cases"][name]
    disk = "not measured (cannot drop the page cache here)" if c["disk_s"] is None else f"{c['disk_s']:.1f} s"
    return [f"checksums     a {c['gb']:.0f} GB checkpoint: {c['cached_s']:.1f} s from the page cache (a save), "
            f"{disk} from the disk (a resume)"]


def show_stream(name: str, report: dict) -> list[str]:
    return ["stream        " + "; ".join(f"{r['sequences']:,} sequences of a {int(n):,}-row file in {r['seconds']:.0f} "
                                        f"s, peak RSS {r['peak_rss_gb']:.2f} GiB"
                                        for n, r in report["cases"][name].items())]
