"""The bench's data cases (`sft.bench.run`), each run in a process of its own by `sft.bench.cases.child`:
preprocessing into a cache and loading from it (`preprocess`), tokenising side by side with sft 0.1 and the
tokenizer's own chat path (`tokenize`), preprocessing at scale (`scale`), reading a stream (`stream`), and a 7B
checkpoint's checksums (`checksums`)."""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path


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
    `sft.data.labels.tokenize_batch`, by sft 0.1's (`sft.bench.baseline`), both through `datasets.map` as preprocessing
    runs them, and by the tokenizer's own chat path through it too (`chat_template_batch`: one render and the encoding
    a chat, no labels); and by the tokenizer alone on the texts already rendered (`encode`). Also how many
    chat-template renders a row costs."""
    from datasets import Dataset, disable_progress_bars
    from hydra.utils import instantiate

    from sft.bench import baseline as bench_baseline
    from sft.data import labels as sft_labels
    from sft.data.chat_settings import chat_settings
    from sft.data.labels import encode, tokenize_batch
    from sft.data.preprocess import write_rows
    from sft.data.rows import iter_jsonl
    from sft.data.spec import Labelling
    from sft.data.templates import ChatRenderer
    from sft.data.turns import chat_views

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
    labelled, weighed: `sft.data.streaming`), from the tokenizer's start: seconds and this process's peak resident
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
