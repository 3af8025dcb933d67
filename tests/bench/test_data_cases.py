"""The bench's data cases (`sft.bench.data_cases`) through their drivers, run in this process: a stream read from
files of two sizes, and their figures."""

import pytest


@pytest.mark.slow  # two streams read (the tiny model's tokenizer; about 10 s)
def test_the_stream_case_reads_each_file_as_far_as_asked_and_compares_their_memory(tmp_path):
    from sft.bench.cases import CASES, Context
    from sft.bench.config import compose
    from sft.bench.run import free_port, run_case

    overrides = ["bench.stream_rows=[30,300]", "bench.stream_read=40"]
    context = Context(overrides, compose(overrides), compose, lambda case, cfg, env=None: run_case(case, cfg),
                      free_port)
    figures, ratios = CASES["stream"].drive(context)
    assert set(figures) == {"30", "300"}
    assert figures["30"]["sequences"] == 30 and figures["300"]["sequences"] == 40  # a smaller file is read whole
    assert ratios["stream_peak_rss_ratio"] == figures["300"]["peak_rss_gb"] / figures["30"]["peak_rss_gb"]
    assert ratios["stream_sequences_per_second"] == 40 / figures["300"]["seconds"]
    report = {"cases": {"stream": figures}}
    assert "40 sequences of a 300-row file" in CASES["stream"].show("stream", report)[0]
