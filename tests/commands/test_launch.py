"""`sft launch`: what it says of ranks that failed without a recorded error (the recorded ones:
tests/training/processes/test_rank_errors.py; whole launches: tests/e2e/test_distributed.py)."""

from sft.commands.launch import failure_line


def test_a_crash_without_a_recorded_error_is_named_by_rank_and_signal():
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    failures = {1: ProcessFailure(local_rank=1, pid=11, exitcode=-9, error_file=""),
                0: ProcessFailure(local_rank=0, pid=10, exitcode=1, error_file="")}
    assert failure_line(failures) == "rank 0 exited with code 1 (1 other rank(s) failed too); its output is above"
    assert failure_line({1: failures[1]}) == "rank 1 was killed by SIGKILL; its output is above"
