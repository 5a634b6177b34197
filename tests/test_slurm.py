"""The workflow on a real SLURM cluster through workflow/profiles/slurm: munge, slurmctld and slurmd
(Debian's slurm-wlm) started on this host with one node that has a GPU gres, the CPU part of a
small grid's DAG run end to end, and GPU jobs submitted with --gpus=1 and run on the gres GPU.

The node is configured as the reference hosts' share of one GPU (16 CPUs, 64 GB; slurmd takes
the configured values, config_overrides), so the GPU jobs' requests are the profile's own. No
cgroups: jobs see the host, and SLURM binds the GPU through CUDA_VISIBLE_DEVICES. The cluster is
configless (slurmd fetches slurm.conf from slurmctld), since the job steps' srun does not inherit
SLURM_CONF; so it needs munge on its default socket and /run/slurm free: the test skips, saying
why, where this host runs a SLURM of its own or a daemon does not start.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
from workflow_support import (copy_workflow, failure, fake_calls, fake_gpu_env, needs_snakemake, small_config,
                              snakemake)

from persistentkv.render import FIGURE_NAMES

pytestmark = [needs_snakemake, pytest.mark.slow]

MUNGE_SOCKET = Path("/run/munge/munge.socket.2")
RUN_SLURM = Path("/run/slurm/conf")
DAEMONS = ("munged", "munge", "unmunge", "slurmctld", "slurmd", "sbatch", "squeue", "sinfo", "scontrol")
#: Quick polling: SLURM's jobs here take seconds, not hours.
SLURM_OPTIONS = ("--slurm-status-command", "squeue", "--slurm-init-seconds-before-status-checks", "1",
                 "--jobs", "4", "--latency-wait", "10")


def skip_reason() -> str | None:
    missing = [exe for exe in DAEMONS if shutil.which(exe) is None]
    if missing:
        return f"needs Debian's slurm-wlm and munge (missing {', '.join(missing)}): apt-get install slurm-wlm munge"
    if importlib.util.find_spec("snakemake_executor_plugin_slurm") is None:
        return "needs snakemake-executor-plugin-slurm: pip install -e '.[cluster]'"
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users and must run as root"
    if Path("/etc/slurm/slurm.conf").exists():
        return "/etc/slurm/slurm.conf exists: this host has a SLURM of its own, which the test leaves alone"
    if RUN_SLURM.is_symlink() and not RUN_SLURM.exists():
        RUN_SLURM.unlink()  # left by an earlier run of this test that was killed
    if RUN_SLURM.exists():
        return f"{RUN_SLURM} exists: a configless slurmd of another cluster runs here"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def munge_works() -> bool:
    encoded = subprocess.run(["munge", "-n"], capture_output=True, timeout=10)
    return encoded.returncode == 0 and subprocess.run(["unmunge"], input=encoded.stdout, capture_output=True,
                                                      timeout=10).returncode == 0


def slurm_conf(root: Path, ctld_port: int, slurmd_port: int) -> str:
    host = socket.gethostname().split(".")[0]
    return f"""ClusterName=pkvtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
SlurmctldParameters=enable_configless
SlurmdParameters=config_overrides
AuthType=auth/munge
CredType=cred/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=none
ReturnToService=2
MinJobAge=3600
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
GresTypes=gpu
KillWait=5
NodeName={host} NodeAddr=127.0.0.1 CPUs=16 RealMemory=64000 Gres=gpu:1 State=UNKNOWN
PartitionName=main Nodes={host} Default=YES MaxTime=INFINITE State=UP
"""


def last_lines(path: Path, n: int = 3) -> str:
    lines = path.read_text(errors="replace").splitlines() if path.is_file() else []
    return " | ".join(line.strip() for line in lines[-n:]) or f"{path.name} is empty"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """SLURM_CONF of a one-node cluster on this host; the daemons stop after the module."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    root = tmp_path_factory.mktemp("slurm")
    for sub in ("state", "spool", "munge"):
        (root / sub).mkdir()
    conf = root / "slurm.conf"
    conf.write_text(slurm_conf(root, free_port(), free_port()))
    # a fake GPU device file: slurmd reads its minor number to tell the job's GPU index
    (root / "gres.conf").write_text(f"NodeName={socket.gethostname().split('.')[0]} Name=gpu File=/dev/null\n")
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons: list[subprocess.Popen] = []

    def start(cmd, log: Path, ready, what: str) -> None:
        daemons.append(subprocess.Popen(cmd, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT))
        deadline = time.monotonic() + 30
        while not ready():
            if daemons[-1].poll() is not None or time.monotonic() > deadline:
                stop()
                pytest.skip(f"{what} did not start here: {last_lines(log)}")
            time.sleep(0.3)

    def stop() -> None:
        subprocess.run(["scontrol", "shutdown"], env=env, capture_output=True, timeout=30)
        for proc in reversed(daemons):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        if RUN_SLURM.is_symlink() and str(root) in os.readlink(RUN_SLURM):
            RUN_SLURM.unlink()

    if not (MUNGE_SOCKET.exists() and munge_works()):
        MUNGE_SOCKET.parent.mkdir(parents=True, exist_ok=True)
        key = root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        start(["munged", "--foreground", "--force", f"--key-file={key}", f"--log-file={root}/munged.log",
               f"--pid-file={root}/munge/munged.pid", f"--seed-file={root}/munge/seed"],
              root / "munged.out", munge_works, "munged")
    start(["slurmctld", "-D", "-f", str(conf)], root / "slurmctld.out",
          lambda: subprocess.run(["scontrol", "ping"], env=env, capture_output=True, text=True).stdout.count("UP") > 0,
          "slurmctld")
    ctld = re.search(r"SlurmctldPort=(\d+)", conf.read_text()).group(1)
    start(["slurmd", "-D", "--conf-server", f"127.0.0.1:{ctld}"], root / "slurmd.out",
          lambda: subprocess.run(["sinfo", "-h", "-o", "%T"], env=env, capture_output=True,
                                 text=True).stdout.strip() in ("idle", "mixed", "allocated"),
          "slurmd")
    yield env
    stop()


def test_the_cpu_dag_runs_through_slurm_and_gpu_jobs_get_a_gpu(cluster, tmp_path):
    repo = copy_workflow(tmp_path / "repo")
    small_config(repo, target="none")
    env = {**fake_gpu_env(tmp_path, ["NVIDIA H200"]), "SLURM_CONF": cluster["SLURM_CONF"]}
    done = snakemake(repo, "all", "--workflow-profile", "workflow/profiles/slurm", *SLURM_OPTIONS, env=env)
    assert done.returncode == 0, failure(done, repo)
    assert "has been submitted with SLURM jobid" in done.stderr
    for path in (["results/counters/validation_cpu.parquet", "results/counters/ablation_buckets.parquet",
                  "results/counters/ablation_splits.svg", "results/nvidia-h200/claims.json",
                  "results/nvidia-h200/report.html", "paper/generated/macros.tex"]
                 + [f"paper/generated/figures/{name}.pdf" for name in FIGURE_NAMES]):
        assert (repo / path).stat().st_size > 0, path
    again = snakemake(repo, "-n", "all", "--workflow-profile", "workflow/profiles/slurm", env=env)
    assert "Nothing to be done" in again.stdout + again.stderr

    # the GPU jobs of the same DAG: submitted with the profile's GPU request, bound to the gres GPU
    small_config(repo, target="nvidia-h200")
    done = snakemake(repo, "results/nvidia-h200/bench_kernels.parquet", "results/nvidia-h200/raw/calibration.parquet",
                     "--workflow-profile", "workflow/profiles/slurm", *SLURM_OPTIONS, "--verbose", env=env)
    assert done.returncode == 0, failure(done, repo)
    sbatch = re.findall(r"sbatch call: (.*)", done.stderr)
    gpu_lines = [line for line in sbatch if "rule_bench_kernels" in line or "rule_measure" in line]
    assert len(gpu_lines) == 2, sbatch
    assert all("--gpus" not in line for line in sbatch if line not in gpu_lines)
    for line in gpu_lines:
        assert " --gpus=1" in line and "--cpus-per-task=16" in line and " -t 60" in line and "--mem 32000" in line
    calls = [c for c in fake_calls(tmp_path) if c["command"] in ("bench-kernels", "measure")]
    assert len(calls) == 2
    for call in calls:
        assert call["slurm_job_id"] and call["cuda_visible_devices"] == "GPU-fake-0"
        assert call["held"]["gpu_index"] == 0 and call["held"]["gpu_name"] == "NVIDIA H200"
