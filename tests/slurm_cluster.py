"""A real SLURM on this machine, for the tests that need one: Debian's slurmctld, two slurmd "nodes" on one host
(Debian's build runs several, `slurmd -N <node>`), slurmdbd on a MariaDB of its own (accounting: `sacct`, from which
submitit reads job states; without it every state is UNKNOWN), and munge; everything on 127.0.0.1, started without
systemd, stopped by the PIDs it started (a munged already running is used, not stopped).

Two partitions on both nodes: `low` (the default, preemptible: PreemptMode=REQUEUE, GraceTime 30 s) and `high`, whose
jobs preempt `low`'s. `JobRequeue=1` and `RequeueExit=75` (a run stopped at a signal exits 75 and is requeued), and
`AuthInfo=cred_expire=10`: a requeued job may start again after 10 s, not SLURM's 120.

    python tests/slurm_cluster.py install      # the packages, where missing (root and a package index: .ci/run)
    python tests/slurm_cluster.py up <dir>     # start one and wait (Ctrl-C stops it): to try things by hand
    with Cluster(tmp_path) as cluster:         # the tests: configs written, daemons up, `sinfo` idle; then stopped
        subprocess.run(["sbatch", ...], env=cluster.env)

`unavailable()` says why there can be none (not root, the packages missing): the SLURM tests skip saying it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "slurmdbd", "mariadb-server"]
PROGRAMS = ["slurmctld", "slurmd", "slurmdbd", "munged", "mariadbd", "mariadb-install-db", "sbatch", "sacct"]
NODES = ("node1", "node2")
CPUS_PER_NODE = 2
MEMORY_MB = 8000
GRACE_S = 30  # the preemptible partition's GraceTime: SIGTERM, then this long before SIGKILL


def unavailable() -> str | None:
    """Why no test cluster can start here, or None."""
    if os.geteuid() != 0:
        return "the test cluster runs slurmctld and slurmd as root (SlurmUser=root): not root here"
    missing = [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): python tests/slurm_cluster.py install "
                "(.ci/run does)")
    return None


def install() -> int:
    """apt-get install the packages where a program is missing (as root, from Debian's index)."""
    if unavailable() is None:
        return 0
    if os.geteuid() != 0:
        print("slurm_cluster: not root: cannot install SLURM; the SLURM tests skip", file=sys.stderr)
        return 1
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES],
                    ["apt-get", "update", "-q"], ["apt-get", "install", "-y", "-q", "--no-install-recommends",
                                                  *PACKAGES]):
        if subprocess.run(command, env=env, stdout=subprocess.DEVNULL).returncode == 0 and unavailable() is None:
            return 0
    print("slurm_cluster: apt-get could not install SLURM; the SLURM tests skip", file=sys.stderr)
    return 1


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """A one-host SLURM in `root` (configs, state, logs), up within the `with` block."""

    def __init__(self, root: str | Path, name: str = "sfttest"):
        self.root, self.name = Path(root).resolve(), name
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._started: list[subprocess.Popen] = []
        self._pidfiles: list[Path] = []

    # ---- the configs ----------------------------------------------------------------------------------------------
    def write_configs(self) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "state").mkdir(exist_ok=True)
        host, ports = socket.gethostname(), {name: free_port() for name in ("ctld", "dbd", "mysql", *NODES)}
        self.ports = ports
        nodes = "\n".join(f"NodeName={n} NodeHostname={host} NodeAddr=127.0.0.1 Port={ports[n]} CPUs={CPUS_PER_NODE} "
                          f"RealMemory={MEMORY_MB} State=UNKNOWN" for n in NODES)
        self.conf.write_text(f"""ClusterName={self.name}
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ports['ctld']}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=cred_expire=10
StateSaveLocation={self.root}/state
SlurmdSpoolDir={self.root}/spool-%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=1,sched_interval=2
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
JobRequeue=1
RequeueExit=75
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
KillWait=5
MinJobAge=600
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
AccountingStoragePort={ports['dbd']}
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
{nodes}
PartitionName=low Nodes={','.join(NODES)} Default=YES PriorityTier=1 PreemptMode=REQUEUE GraceTime={GRACE_S} MaxTime=INFINITE State=UP
PartitionName=high Nodes={','.join(NODES)} PriorityTier=10 PreemptMode=OFF MaxTime=INFINITE State=UP
""")
        dbd = self.root / "slurmdbd.conf"
        dbd.write_text(f"""AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
DbdPort={ports['dbd']}
SlurmUser=root
PidFile={self.root}/slurmdbd.pid
LogFile={self.root}/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=127.0.0.1
StoragePort={ports['mysql']}
StorageUser=root
StorageLoc=slurm_acct_db
""")
        dbd.chmod(0o600)

    # ---- the daemons ----------------------------------------------------------------------------------------------
    def _spawn(self, command: list[str], **kwargs) -> subprocess.Popen:
        log = open(self.root / f"{Path(command[0]).name}-{len(self._started)}.out", "w")
        process = subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                   **kwargs)
        self._started.append(process)
        return process

    def _munge(self) -> None:
        """munged as user munge, where none answers already (then that one is used and left running)."""
        if subprocess.run(["munge", "-n"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0:
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        self._spawn(["runuser", "-u", "munge", "--", "/usr/sbin/munged", "--foreground"])
        wait_for(lambda: subprocess.run(["munge", "-n"], stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL).returncode == 0, 20, "munged to answer")

    def _mariadb(self) -> None:
        data = self.root / "mysql"
        subprocess.run(["mariadb-install-db", f"--datadir={data}", "--user=root", "--auth-root-authentication-method"
                        "=normal", "--skip-test-db"], env=self.env, check=True, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        self._spawn(["/usr/sbin/mariadbd", "--no-defaults", f"--datadir={data}", "--user=root",
                     f"--socket={self.root}/mysql.sock", f"--pid-file={self.root}/mysql.pid",
                     "--bind-address=127.0.0.1", f"--port={self.ports['mysql']}", "--skip-grant-tables",
                     "--innodb-buffer-pool-size=32M", "--skip-log-bin"])
        wait_for(lambda: _port_open(self.ports["mysql"]), 60, "MariaDB to listen")

    def start(self) -> Cluster:
        self.write_configs()
        self._munge()
        self._mariadb()
        self._spawn(["/usr/sbin/slurmdbd", "-D"])  # slurmdbd.conf beside $SLURM_CONF
        wait_for(lambda: _port_open(self.ports["dbd"]), 60, "slurmdbd to listen")
        self._spawn(["/usr/sbin/slurmctld", "-D", "-i", "-f", str(self.conf)])
        wait_for(lambda: self.run(["scontrol", "ping"]).returncode == 0, 60, "slurmctld to answer")
        for node in NODES:
            self.start_node(node)
        wait_for(lambda: self.idle_nodes() == set(NODES), 60, "both nodes idle in sinfo")
        # submitit (and the tests) read job states from accounting: the cluster must be registered there
        wait_for(lambda: self.run(["sacct", "-n", "-X", "-a"]).returncode == 0, 60, "sacct to answer")
        return self

    def start_node(self, node: str) -> None:
        self._spawn(["/usr/sbin/slurmd", "-D", "-N", node, "-f", str(self.conf)])

    def stop(self) -> None:
        """End every process this cluster started, by PID: its jobs' first (cancelled, then whatever is left of
        them: `slurmstepd` runs each job step in a session of its own, out of reach of the daemons'), then the
        daemons."""
        if self._started:
            with _ignored():
                self.run(["scancel", "--full", "--signal=KILL", "--user=root"], timeout=30)
                wait_for(lambda: not self.run(["squeue", "-h"], timeout=30).stdout.strip(), 15, "the queue empty")
        for process in reversed(self._started):
            with _ignored():
                os.killpg(process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 20
        for process in reversed(self._started):
            try:
                process.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                with _ignored():
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        self._started.clear()
        for pid in self.leftovers():  # job processes the cancel did not reach (their slurmd already gone)
            with _ignored():
                os.kill(pid, signal.SIGKILL)

    def leftovers(self) -> list[int]:
        """The processes still running that this cluster started: every daemon and job process carries its
        SLURM_CONF in its environment (the tests' own processes excepted: this one and its parents)."""
        mine, marker, found = _ancestors(), f"SLURM_CONF={self.conf}".encode(), []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) not in mine:
                with _ignored():
                    if marker in (entry / "environ").read_bytes().split(b"\0"):
                        found.append(int(entry.name))
        return found

    def __enter__(self) -> Cluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- asking it --------------------------------------------------------------------------------------------------
    def run(self, command: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(command, env=self.env, capture_output=True, text=True, **kwargs)

    def idle_nodes(self) -> set[str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"]).stdout.split()
        return {name for name, state in zip(out[::2], out[1::2]) if state == "idle"}

    def job_state(self, job_id: str) -> str:
        """The job's state in accounting (`sacct`), e.g. RUNNING, REQUEUED, COMPLETED, FAILED; "" while unknown."""
        out = self.run(["sacct", "-n", "-X", "-P", "-j", job_id, "-o", "State"]).stdout.split()
        return out[0].split()[0] if out else ""

    def logs(self) -> str:
        """The daemons' logs' tails, for a failing test's message."""
        return "\n".join(f"== {p.name}\n" + p.read_text(errors="replace")[-2000:]
                         for p in sorted(self.root.glob("*.log")))


def wait_for(ready, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not ready():
        if time.monotonic() > deadline:
            raise TimeoutError(f"slurm_cluster: waited {timeout:g} s for {what}")
        time.sleep(0.3)


def _ancestors() -> set[int]:
    """This process and its parents, up to init."""
    pids, pid = set(), os.getpid()
    while pid > 1 and pid not in pids:
        pids.add(pid)
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return pids


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


class _ignored:
    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        return kind is not None and issubclass(kind, (OSError, subprocess.SubprocessError))


if __name__ == "__main__":
    if sys.argv[1:2] == ["install"]:
        sys.exit(install())
    if sys.argv[1:2] == ["up"] and len(sys.argv) == 3:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # a SIGTERM stops the cluster too (its `with` ends)
        with Cluster(sys.argv[2]) as cluster:
            print(f"up: export SLURM_CONF={cluster.conf}  (Ctrl-C stops it)", flush=True)
            with _ignored():
                signal.pause()
        sys.exit(0)
    print(__doc__, file=sys.stderr)
    sys.exit(2)
