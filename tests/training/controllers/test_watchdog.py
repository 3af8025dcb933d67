"""The hang watchdog's armed report (`sft.training.controllers.watchdog`): a header that reads truthfully whether
stacks follow it (a hang) or not (a process that died before anything tidied the file), and is removed at a clean end."""

from types import SimpleNamespace

from sft.training.controllers.watchdog import HangWatchdog


def test_the_armed_report_says_what_it_means_with_and_without_stacks_and_goes_at_a_clean_end(tmp_path):
    watchdog = HangWatchdog(timeout_s=300)
    args, state = SimpleNamespace(output_dir=str(tmp_path)), SimpleNamespace(global_step=3)
    watchdog.on_train_begin(args, state, None)
    report = tmp_path / "hangs" / "rank-0.txt"
    header = report.read_text()
    assert header.startswith("rank 0: watching for a hang after step 3 (armed ")
    assert "Where the stacks of every thread follow, no optimizer step completed within 300 s after step 3" in header
    assert "Where none follow, there was no hang: the process ended otherwise (killed, or it exited at once)" in header
    state.global_step = 4
    watchdog.on_step_end(args, state, None)  # re-armed: the step it watches after
    assert report.read_text().startswith("rank 0: watching for a hang after step 4 (armed ")
    watchdog.on_train_end(args, state, None)
    assert not report.exists() and not report.parent.exists()
