"""Training under a real SLURM (`tests/slurm_cluster.py`: two nodes on this host, a preemptible partition `low` and
`high`, whose jobs preempt it; accounting on). What users grow into past one box, run for real:

- a sweep whose jobs are SLURM jobs ends in the verdict a local sweep gives; what SLURM refuses is one line; a job
  SLURM queued but will never start, and a signal to the sweep, cancel its jobs; a failed job is exit code 3;
- a job preempted by the higher partition, signalled with `scancel --signal=TERM`, and warned of its time limit
  (`--signal`) saves each time, requeues itself and continues in its run dir, to the step losses of the run never
  stopped; a requeue after its checkpoint was removed is refused in one line, not trained again from the start;
- two nodes (`examples/slurm/train.sbatch`, run by tests/e2e/test_examples.py too) under FSDP2 equal one process
  taking the same global batch, and a refusal inside the ranks is one line naming the node and rank;
- `scancel` cancels: the run stops at its checkpoint, not requeued, and the command it prints continues it;
- a job whose node goes down mid-run continues on the other once SLURM requeues it (and sft says so);
- the cluster ends every process it started, a job running at its end included (tests/conftest.py's `slurm`).

Each wait is bounded: a hang fails the test with the cluster's logs."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, SMALL_EVAL, step_losses

pytestmark = pytest.mark.slow

EXACT = ["trainer.optim=sgd", "trainer.learning_rate=0.5", "trainer.lr_scheduler_type=constant",
         "trainer.warmup_steps=0", "clip=none", "trainer.train_sampling_strategy=sequential", "trainer.logging_steps=1",
         "trainer.eval_steps=1000", "trainer.report_to=[]", f"data.eval_file={SMALL_EVAL}"]

# A controller that makes each step take a while, so that signals land mid-run on a tiny model; a SLURM job's attempts
# from `restarts` on train at full speed (once no signal is awaited)
SLOW_STEPS = """
import os
import time
from sft.training.controllers.base import Controller

class SlowSteps(Controller):
    name = "slow"

    def __init__(self, seconds: float, restarts: int = 1000):
        self.seconds, self.restarts = seconds, restarts

    def on_step_end(self, args, state, control, **kwargs):
        if int(os.environ.get("SLURM_RESTART_COUNT") or 0) < self.restarts:
            time.sleep(self.seconds)
"""


def env(cluster, tmp_path) -> dict:
    return {**cluster.env, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def sft(*args, cluster, tmp_path, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sft", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env=env(cluster, tmp_path))


def sbatch(cluster, tmp_path, *args) -> str:
    out = subprocess.run(["sbatch", "--parsable", f"--output={tmp_path}/slurm-%j.out", "--open-mode=append", *args],
                         cwd=REPO, capture_output=True, text=True, env=env(cluster, tmp_path), timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().split(";")[0]


def wait(cluster, condition, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"waited {timeout:g} s for {what}\n{cluster.logs()}", pytrace=False)
        time.sleep(0.5)


ENDED = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "OUT_OF_MEMORY", "NODE_FAIL", "BOOT_FAIL", "DEADLINE"}


def wait_until_ended(cluster, job: str, state: str, timeout: float, output: Path) -> None:
    """Until the job ends in `state`; one that ends otherwise fails at once, with the job's output."""
    def ended():
        now = cluster.job_state(job)
        if now in ENDED - {state}:
            text = output.read_text(errors="replace")[-4000:] if output.is_file() else ""
            pytest.fail(f"job {job} ended {now}, not {state}\n{text}\n{cluster.logs()}", pytrace=False)
        return now == state
    wait(cluster, ended, timeout, f"job {job} to end {state}")


def logged_steps(run: Path) -> list[int]:
    path = run / "metrics.jsonl"
    lines = path.read_text().splitlines() if path.is_file() else []
    return [json.loads(line)["step"] for line in lines if line.strip() and '"loss"' in line]


def preemptions(run: Path) -> list[dict]:
    try:
        return json.loads((run / "results.json").read_text()).get("preemptions", [])
    except (OSError, ValueError):
        return []


def test_a_sweep_through_slurm_ends_in_the_verdict_of_a_local_sweep(slurm, tmp_path):
    """Each job a SLURM array task on a CPU allocation (`hydra/launcher=slurm_cpu`), the report written once every
    job ended: the same verdict and numbers as the same sweep run locally. A second sweep into its dir, a partition
    that does not exist and more memory than a node has are each one line, exit 2, before anything runs."""
    common = ["-m", "loss=ce,hard_sample", "trainer.max_steps=4", *EXACT]
    local = sft("train", *common, f"hydra.sweep.dir={tmp_path}/local", cluster=slurm, tmp_path=tmp_path)
    assert local.returncode == 0, local.stderr[-3000:]
    remote = sft("train", *common, "hydra/launcher=slurm_cpu", "hydra.launcher.mem_gb=1",
                 f"hydra.sweep.dir={tmp_path}/slurm", cluster=slurm, tmp_path=tmp_path)
    assert remote.returncode == 0, remote.stderr[-3000:] + slurm.logs()

    def verdict(folder):
        text = (tmp_path / folder / "sweep_summary.md").read_text()
        return text[text.index("## Verdict"):text.index("## Jobs")]

    assert verdict("slurm") == verdict("local") and "loss=hard_sample against loss=ce" in verdict("slurm")
    jobs = [json.loads((tmp_path / "slurm" / str(n) / "results.json").read_text()) for n in (0, 1)]
    assert all(j["status"] == "ok" and "_" in j["slurm_job"] for j in jobs)  # each an array task

    again = sft("train", *common, "hydra/launcher=slurm_cpu", f"hydra.sweep.dir={tmp_path}/slurm", cluster=slurm,
                tmp_path=tmp_path)
    assert again.returncode == 2 and again.stderr.strip().startswith("error: config: hydra.sweep.dir=") and \
        "holds another sweep's jobs" in again.stderr and len(again.stderr.strip().splitlines()) == 1, again.stderr
    for number, (override, reason) in enumerate((("hydra.launcher.partition=nope", "invalid partition specified: nope"),
                                                 ("hydra.launcher.mem_gb=999", "Memory specification can not be "
                                                  "satisfied"))):
        refused = sft("train", *common, "hydra/launcher=slurm_cpu", override, f"hydra.sweep.dir={tmp_path}/no{number}",
                      cluster=slurm, tmp_path=tmp_path, timeout=120)
        assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
            f"error: slurm: sbatch refused the sweep's jobs: {refused.stderr.split('jobs: ', 1)[1].strip()}"]
        assert reason in refused.stderr, refused.stderr


def test_preempted_and_at_its_time_limit_a_job_goes_on_to_the_uninterrupted_losses(slurm, tmp_path):
    """One job through two stops: preempted by a job of the higher partition (SIGTERM), and SIGUSR2 35 s before its
    two-minute limit (`--signal`). Each time it finishes the step, saves, requeues itself and exits 75; the next
    attempt continues the run in the same dir (no resume=auto given), and its step losses are the uninterrupted run's,
    every step logged once. The preemptions are in results.json. (SLURM sends the warning at its first 30-second pass
    within 30 s of it being due: 55 to 85 s into an attempt here, after the first stop and before the second attempt
    could finish; the third trains at full speed. `scancel --signal=TERM`, the third way a job is stopped, is the
    stop of the next two tests.)"""
    (tmp_path / "slow_steps.py").write_text(SLOW_STEPS)
    overrides = [*EXACT, "trainer.max_steps=300", "trainer.save_steps=300", "trainer.per_device_train_batch_size=4"]
    whole = tmp_path / "whole"  # the uninterrupted run, trained meanwhile: the job's steps mostly sleep
    ref_log = tmp_path / "whole.log"
    ref = subprocess.Popen([sys.executable, "-m", "sft", "train", *overrides, f"hydra.run.dir={whole}"], cwd=REPO,
                           stdout=subprocess.DEVNULL, stderr=ref_log.open("w"), env=env(slurm, tmp_path))
    run = tmp_path / "run"
    job = sbatch(slurm, tmp_path, "--nodes=1", "--time=2", "--signal=USR2@35", str(REPO / "examples/slurm/train.sbatch"),
                 *overrides, "+controllers.slow={_target_:slow_steps.SlowSteps,seconds:0.3,restarts:2}",
                 f"hydra.run.dir={run}")
    wait(slurm, lambda: len(logged_steps(run)) >= 3, 120, "the job's third step")
    sbatch(slurm, tmp_path, "--partition=high", "--nodes=2", "--ntasks=4", "--mem=100M", "--wrap", "sleep 5")
    wait(slurm, lambda: len(preemptions(run)) == 1, 120, "the preempted job's checkpoint")
    wait(slurm, lambda: len(preemptions(run)) == 2, 180, "the time limit's warning and checkpoint")
    slurm.run(["scontrol", "update", f"jobid={job}", "TimeLimit=10"])  # the last attempt may finish
    wait_until_ended(slurm, job, "COMPLETED", 240, tmp_path / f"slurm-{job}.out")
    assert ref.wait(timeout=300) == 0, ref_log.read_text()[-3000:]

    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "ok" and results["global_step"] == 300
    assert [(p["signal"], p["attempt"], p["slurm_job"]) for p in results["preemptions"]] == [
        ("SIGTERM", 1, job), ("SIGUSR2", 2, job)]
    assert logged_steps(run) == list(range(1, 301))  # every step once: none trained twice
    assert step_losses(run, 300) == pytest.approx(step_losses(whole, 300), rel=1e-6, abs=1e-5)
    log = (tmp_path / f"slurm-{job}.out").read_text()
    # preempted within its GraceTime the job still runs (sft requeues it; where SLURM already had, sft says so); at
    # the warning, sft requeues it
    assert "attempt 2 continues this run from its checkpoint" in log, log[-3000:]
    assert f"SLURM job {job} (signalled while it runs): requeued; attempt 3 continues this run" in log
    assert "not requeued" not in log and "again while stopping" not in log
    train_log = (run / "train.log").read_text()
    assert f"SLURM job {job} (attempt 1, preempted, cancelled with a signal, or at the time limit; the scheduler " \
           "gives partition low's GraceTime=30 s" in train_log
    assert f"SLURM job {job}, attempt 3: continuing the run in {run} (resume=auto)" in train_log


def test_a_requeue_after_the_checkpoint_was_removed_is_one_line_and_ends_the_job(slurm, tmp_path):
    """The checkpoint a stopped attempt saved is gone when the next starts: it would train its steps again from the
    start. Refused in one line, the job failed (not requeued again)."""
    (tmp_path / "slow_steps.py").write_text(SLOW_STEPS)
    run = tmp_path / "run"
    job = sbatch(slurm, tmp_path, "--nodes=1", str(REPO / "examples/slurm/train.sbatch"), *EXACT,
                 "trainer.max_steps=100", "+controllers.slow={_target_:slow_steps.SlowSteps,seconds:0.3}",
                 f"hydra.run.dir={run}")
    wait(slurm, lambda: len(logged_steps(run)) >= 2, 120, "the job's second step")
    slurm.run(["scancel", "--signal=TERM", job])
    wait(slurm, lambda: len(preemptions(run)) == 1, 120, "the signalled job's checkpoint")
    checkpoint = Path(preemptions(run)[0]["checkpoint"])
    shutil.rmtree(checkpoint)  # a requeued job starts again 10 s after (AuthInfo=cred_expire=10): before that
    wait_until_ended(slurm, job, "FAILED", 180, tmp_path / f"slurm-{job}.out")
    log = (tmp_path / f"slurm-{job}.out").read_text()
    assert f"error: config: resume='auto': SLURM job {job}, attempt 2: the checkpoint this run stopped at " \
           f"({checkpoint}, results.json) is gone" in log, log[-3000:]


def test_two_nodes_under_fsdp2_signalled_equal_one_process_and_a_rank_error_is_one_line_naming_node_and_rank(
        slurm, tmp_path):
    """`examples/slurm/train.sbatch` on two nodes, one process each, over gloo, FSDP2, signalled mid-run (`scancel
    --signal=TERM`: every rank saves its shards, the job requeues and goes on): its step losses are one process's with
    the same global batch (DDP's, unsignalled: tests/e2e/test_examples.py). A refusal inside the ranks (a data file
    that is not there, found by every rank) is said once, by rank 0, naming its node."""
    (tmp_path / "slow_steps.py").write_text(SLOW_STEPS)
    one = tmp_path / "one"
    ref = sft("train", *EXACT, "trainer.max_steps=8", "trainer.save_steps=8", "trainer.per_device_train_batch_size=4",
              f"hydra.run.dir={one}", cluster=slurm, tmp_path=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    two = tmp_path / "two"
    job = sbatch(slurm, tmp_path, str(REPO / "examples/slurm/train.sbatch"), *EXACT, "fsdp=full_shard",
                 "trainer.max_steps=8", "trainer.save_steps=8", "trainer.per_device_train_batch_size=2",
                 "+controllers.slow={_target_:slow_steps.SlowSteps,seconds:1.0}", f"hydra.run.dir={two}")
    wait(slurm, lambda: len(logged_steps(two)) >= 2, 180, "the two-node job's second step")
    slurm.run(["scancel", "--signal=TERM", job])
    wait_until_ended(slurm, job, "COMPLETED", 300, tmp_path / f"slurm-{job}.out")
    assert [p["signal"] for p in json.loads((two / "results.json").read_text())["preemptions"]] == ["SIGTERM"]
    assert json.loads((two / "checkpoint-8" / "sft_state.json").read_text())["world_size"] == 2
    assert logged_steps(two) == list(range(1, 9))
    assert step_losses(two, 8) == pytest.approx(step_losses(one, 8), rel=1e-5, abs=1e-5)  # two ranks sum in another order

    bad = subprocess.run(["sbatch", "--parsable", "--wait", f"--output={tmp_path}/bad.out",
                          str(REPO / "examples/slurm/train.sbatch"), f"data.train_file={tmp_path}/missing.jsonl",
                          f"hydra.run.dir={tmp_path}/bad"], cwd=REPO, capture_output=True, text=True,
                         env=env(slurm, tmp_path), timeout=300)
    said = [line for line in (tmp_path / "bad.out").read_text().splitlines() if line.startswith("error:")]
    assert bad.returncode != 0 and len(said) == 1, (tmp_path / "bad.out").read_text()[-3000:]
    assert said[0].startswith("error: ") and "missing.jsonl" in said[0] and said[0].endswith("(node1, rank 0)")


def test_a_job_whose_node_goes_down_mid_run_continues_when_slurm_requeues_it(slurm, tmp_path):
    """`scontrol update nodename=<its node> state=down` while it trains: SLURM ends the job and requeues it (node
    failure), and the next attempt, on the other node, continues from its newest complete checkpoint to the end;
    no step is logged twice, no checkpoint lost."""
    (tmp_path / "slow_steps.py").write_text(SLOW_STEPS)
    run = tmp_path / "run"
    job = sbatch(slurm, tmp_path, "--nodes=1", str(REPO / "examples/slurm/train.sbatch"), *EXACT,
                 "trainer.max_steps=40", "trainer.save_steps=5", "trainer.per_device_train_batch_size=4",
                 "+controllers.slow={_target_:slow_steps.SlowSteps,seconds:0.2}", f"hydra.run.dir={run}")
    wait(slurm, lambda: len(logged_steps(run)) >= 8, 120, "the job's eighth step")
    node = slurm.run(["squeue", "-h", "-j", job, "-o", "%N"]).stdout.strip()
    slurm.run(["scontrol", "update", f"nodename={node}", "state=down", "reason=test"])
    try:
        # (not wait_until_ended: between the attempts accounting may show the node's failure)
        wait(slurm, lambda: slurm.job_state(job) == "COMPLETED", 300, "the job to complete on the other node")
    finally:
        slurm.run(["scontrol", "update", f"nodename={node}", "state=resume"])
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "ok" and results["global_step"] == 40
    steps = logged_steps(run)
    assert steps == sorted(set(steps)) and steps[-1] == 40 and "resume=auto: resuming from" in \
        (run / "train.log").read_text()
    out = (tmp_path / f"slurm-{job}.out").read_text()
    if "SIGTERM: finishing the current step" in out:  # where the run saw the node's end before it was killed
        assert f"SLURM job {job}: SLURM requeues it itself" in out and "not requeued" not in out, out[-3000:]


def test_scancel_cancels_the_run_stops_at_its_checkpoint_and_the_command_it_prints_goes_on(slurm, tmp_path):
    """A plain `scancel` sends SIGTERM as a preemption does: the run saves its checkpoint, reads SLURM's state
    (cancelled, not requeued by SLURM) and leaves the job cancelled, one cancel enough (SLURM 22.05 would accept a
    requeue of it). The command it prints, pasted, continues the run to the uninterrupted losses."""
    (tmp_path / "slow_steps.py").write_text(SLOW_STEPS)
    overrides = [*EXACT, "trainer.max_steps=12", "trainer.save_steps=100"]
    whole = tmp_path / "whole"
    ref = sft("train", *overrides, f"hydra.run.dir={whole}", cluster=slurm, tmp_path=tmp_path)
    assert ref.returncode == 0, ref.stderr[-3000:]
    run = tmp_path / "run"
    job = sbatch(slurm, tmp_path, "--nodes=1", str(REPO / "examples/slurm/train.sbatch"), *overrides,
                 "+controllers.slow={_target_:slow_steps.SlowSteps,seconds:0.5}", f"hydra.run.dir={run}")
    wait(slurm, lambda: len(logged_steps(run)) >= 2, 120, "the job's second step")
    slurm.run(["scancel", job])
    output = tmp_path / f"slurm-{job}.out"
    wait_until_ended(slurm, job, "CANCELLED", 120, output)
    wait(slurm, lambda: "not requeued" in output.read_text(), 60, "the job's last words")
    time.sleep(15)  # a requeued job would start again 10 s after (cred_expire=10)
    assert slurm.job_state(job) == "CANCELLED" and not slurm.run(["squeue", "-h", "-j", job]).stdout.strip()
    said = [line for line in output.read_text().splitlines() if "not requeued" in line]
    assert said == [f"SLURM job {job}: cancelled (CANCELLED by 0: scancel): not requeued; the run stays stopped at "
                    f"its checkpoint in {run} (to go on: sbatch it again with hydra.run.dir={run} resume=auto)"]
    results = json.loads((run / "results.json").read_text())
    assert results["status"] == "preempted" and Path(results["checkpoint"]).is_dir()

    again = sbatch(slurm, tmp_path, "--nodes=1", str(REPO / "examples/slurm/train.sbatch"), *overrides,
                   f"hydra.run.dir={run}", "resume=auto")
    wait_until_ended(slurm, again, "COMPLETED", 180, tmp_path / f"slurm-{again}.out")
    assert logged_steps(run) == list(range(1, 13))
    assert step_losses(run, 12) == pytest.approx(step_losses(whole, 12), rel=1e-6, abs=1e-5)


def test_a_sweep_slurm_will_never_start_a_failed_job_and_a_stopped_sweep_each_say_so_and_leave_nothing_queued(
        slurm, tmp_path):
    """More CPUs than a node has: SLURM queues the jobs (no EnforcePartLimits) as PENDING (PartitionConfig), and the
    sweep says so in one line, exit 2, its jobs cancelled. A job that fails (its data file missing): the report is
    written and the sweep exits 3. A SIGTERM to the sweep while its jobs run cancels them (each saving its checkpoint)
    and exits 75."""
    common = ["trainer.max_steps=4", *EXACT, "hydra/launcher=slurm_cpu", "hydra.launcher.mem_gb=1"]
    never = sft("train", "-m", "loss=ce,hard_sample", *common, "hydra.launcher.cpus_per_task=8",
                f"hydra.sweep.dir={tmp_path}/never", cluster=slurm, tmp_path=tmp_path, timeout=180)
    lines = never.stderr.strip().splitlines()
    assert never.returncode == 2 and lines[-1].startswith("error: slurm: SLURM queued the sweep's jobs but will never "
                                                          "start job ") and \
        "(PENDING PartitionConfig: asks more CPUs, memory or GPUs than the partition's nodes have); the sweep's 2 " \
        "job(s) cancelled" in lines[-1] and not any("Traceback" in line for line in lines), never.stderr[-3000:]
    wait(slurm, lambda: not slurm.run(["squeue", "-h"]).stdout.strip(), 30, "the never-starting jobs gone")

    failed = sft("train", "-m", f"data.train_file={tmp_path}/missing.jsonl", *common,
                 f"hydra.sweep.dir={tmp_path}/failed", cluster=slurm, tmp_path=tmp_path)
    assert failed.returncode == 3 and (tmp_path / "failed" / "sweep_summary.md").is_file(), failed.stderr[-3000:]
    assert "error: 1 job(s) of the sweep" in failed.stderr and "missing.jsonl" in failed.stderr

    (tmp_path / "slow_steps.py").write_text(SLOW_STEPS)
    log = tmp_path / "stopped.log"
    sweep = subprocess.Popen([sys.executable, "-m", "sft", "train", "-m", "loss=ce,hard_sample",
                              *[o for o in common if o != "trainer.max_steps=4"], "trainer.max_steps=100",
                              "+controllers.slow={_target_:slow_steps.SlowSteps,seconds:0.5}",
                              f"hydra.sweep.dir={tmp_path}/stopped"], cwd=REPO, stdout=subprocess.DEVNULL,
                             stderr=log.open("w"), env=env(slurm, tmp_path))
    try:
        wait(slurm, lambda: any(len(logged_steps(tmp_path / "stopped" / str(n))) >= 2 for n in (0, 1)), 180,
             "a job of the sweep at its second step")
        sweep.send_signal(signal.SIGTERM)
        assert sweep.wait(timeout=60) == 75, log.read_text()[-3000:]
    finally:
        sweep.kill()
    said = log.read_text().strip().splitlines()[-1]
    assert said.startswith("stopped: SIGTERM to the sweep: its 2 SLURM job(s) cancelled") and \
        said.endswith("the same command with sweep.resume=true goes on"), log.read_text()[-3000:]
    wait(slurm, lambda: not slurm.run(["squeue", "-h"]).stdout.strip(), 120, "the stopped sweep's jobs gone")
    ran = [n for n in (0, 1) if logged_steps(tmp_path / "stopped" / str(n))]
    for n in ran:  # a running job saved its checkpoint at the cancel
        results = json.loads((tmp_path / "stopped" / str(n) / "results.json").read_text())
        assert results["status"] == "preempted" and Path(results["checkpoint"]).is_dir()
