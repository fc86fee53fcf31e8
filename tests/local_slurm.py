"""A real Slurm cluster on this machine, for tests: Debian's slurm-wlm (slurmctld, slurmd) and munge,
configured in a temporary directory, listening on 127.0.0.1 only, stopped by the PIDs it started.

Two "nodes" (n1, n2) are two slurmd daemons on this host, each with its own NodeName and port
(`slurmd -N`): Slurm schedules, launches (srun) and signals (scancel) them as it would two machines.

    with LocalSlurm(tmp_path) as cluster:
        job = cluster.sbatch(script)
        cluster.wait(job)
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "scancel", "squeue", "scontrol")
APT_PACKAGES = ("slurm-wlm", "munge")
NODES = ("n1", "n2")
PARTITION = "pipetest"


def missing() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]


def ensure_installed() -> str | None:
    """None when slurm-wlm and munge are here (installed with apt-get when missing and we are root),
    else why not."""
    if not missing():
        return None
    if os.geteuid() != 0:
        return f"slurm-wlm/munge missing ({', '.join(missing())}) and not root to apt-get install them"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    for command in (["apt-get", "update", "-qq"],
                    ["apt-get", "install", "-y", "-qq", "--no-install-recommends", *APT_PACKAGES]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            return f"`{' '.join(command)}` failed: {result.stderr.strip()[-300:]}"
    return None if not missing() else f"still missing after apt-get install: {', '.join(missing())}"


def _free_ports(count: int) -> list[int]:
    sockets = []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def _binary(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


class LocalSlurm:
    def __init__(self, directory: Path):
        self.dir = Path(directory)
        self.conf = self.dir / "slurm.conf"
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}

    # ---- lifecycle ----
    def __enter__(self) -> "LocalSlurm":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        d = self.dir
        for sub in ("state", "log", "spool"):
            (d / sub).mkdir(parents=True, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        sock = d / "munge.sock"
        self._spawn("munged", [_binary("munged"), "--foreground", "--force", f"--socket={sock}", f"--key-file={key}",
                               f"--pid-file={d / 'munged.pid'}", f"--seed-file={d / 'munged.seed'}",
                               f"--log-file={d / 'log' / 'munged.log'}"])
        self._wait_for(lambda: sock.exists(), "munged's socket")
        ctld, *node_ports = _free_ports(1 + len(NODES))
        self.conf.write_text(self._config(ctld, node_ports, sock))
        self._spawn("slurmctld", [_binary("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        self._wait_for(lambda: self._run(["scontrol", "ping"], check=False).returncode == 0, "slurmctld")
        for node in NODES:
            self._spawn(f"slurmd-{node}", [_binary("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self._wait_for(lambda: self.idle_nodes() == len(NODES), f"{len(NODES)} idle nodes", timeout=60)

    def _config(self, ctld_port: int, node_ports: list[int], munge_socket: Path) -> str:
        d = self.dir
        nodes = "\n".join(f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={os.cpu_count()} "
                          "RealMemory=1000 State=UNKNOWN" for name, port in zip(NODES, node_ports))
        # proctrack/linuxproc and task/none: no cgroups in a container; no accounting daemon.
        return f"""ClusterName=pipetest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
CommunicationParameters=NoInAddrAny
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={munge_socket}
CredType=cred/munge
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
MpiDefault=none
ReturnToService=2
JobRequeue=1
SlurmdTimeout=60
KillWait=10
{nodes}
PartitionName={PARTITION} Nodes={','.join(NODES)} Default=YES MaxTime=INFINITE State=UP
"""

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.dir / "log" / f"{name}.out", "w")
        self.procs.append(subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True))
        log.close()

    def _wait_for(self, ready, what: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if ready():
                return
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                break
            time.sleep(0.5)
        raise RuntimeError(f"local Slurm: {what} not ready (exited: {dead if dead else 'none'}); logs in {self.dir / 'log'}:\n"
                           + self.logs())

    def logs(self) -> str:
        return "\n".join(f"== {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
                         for p in sorted((self.dir / "log").glob("*")))

    def stop(self) -> None:
        if self.conf.exists() and any(p.poll() is None for p in self.procs):
            self._run(["scancel", "--full", f"--partition={PARTITION}"], check=False)
        for proc in reversed(self.procs):  # slurmd, slurmctld, then munged: each by the PID we started
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=10)
        self.procs.clear()

    # ---- the client commands ----
    def _run(self, command: list[str], check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run([_binary(command[0]), *command[1:]], env={**self.env, **(env or {})},
                                capture_output=True, text=True, timeout=60)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(command)}: {result.stderr.strip()}")
        return result

    def idle_nodes(self) -> int:
        out = self._run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False).stdout.split("\n")
        return sum(1 for line in out if line.split()[-1:] == ["idle"])

    def sbatch(self, script: Path, env: dict | None = None) -> str:
        return self._run(["sbatch", "--parsable", str(script)], env=env).stdout.strip().split(";")[0]

    def scancel(self, job: str) -> None:
        self._run(["scancel", job])

    def state(self, job: str) -> str:
        """The job's state (PENDING, RUNNING, COMPLETED, CANCELLED, FAILED…) from slurmctld."""
        out = self._run(["scontrol", "show", "job", "-o", job], check=False).stdout
        fields = dict(part.split("=", 1) for part in out.split() if "=" in part)
        return fields.get("JobState", "UNKNOWN")

    def wait(self, job: str, timeout: float = 900, until: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED",
                                                                            "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY")) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            state = self.state(job)
            if state in until:
                return state
            time.sleep(1)
        raise TimeoutError(f"job {job} still {self.state(job)} after {timeout:.0f} s")
