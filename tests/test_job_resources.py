"""persistentkv.job_resources: every workflow job holds CPUs of its own, a GPU job also a GPU of the
target's kind, under locks that die with the job; and what it held reaches the provenance."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workflow_support import ROOT, gpu_env

from persistentkv import hardware, job_resources, provenance
from persistentkv.errors import PKVError

CPUS = sorted(os.sched_getaffinity(0))
two_cpus = pytest.mark.skipif(len(CPUS) < 2, reason=f"needs two CPUs to share out; this process may use {CPUS}")

SHOW = ("import json, os; print(json.dumps({'cpus': sorted(os.sched_getaffinity(0)), "
        "'cvd': os.environ.get('CUDA_VISIBLE_DEVICES'), "
        "'held': json.loads(os.environ['PERSISTENTKV_JOB_RESOURCES'])}))")


def env_with(tmp_path: Path, gpus: list[str] | None, **extra) -> dict:
    env = {k: v for k, v in gpu_env(tmp_path / "bin", gpus).items() if k not in ("SLURM_JOB_ID", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in [str(ROOT / "src"), env.get("PYTHONPATH")] if p)
    env.update(extra)
    return env


def job(tmp_path: Path, env: dict, *args, command=(sys.executable, "-c", SHOW), wait=True):
    """``python -m persistentkv.job_resources ARGS -- COMMAND`` in ``tmp_path`` (its .snakemake/job_resources/)."""
    cmd = [sys.executable, "-m", "persistentkv.job_resources", *args, "--", *command]
    if not wait:
        return subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, text=True)
    return subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60)


def holding(tmp_path: Path, env: dict, *args) -> subprocess.Popen:
    """A job that has taken its CPUs (and GPU) and sleeps until killed."""
    proc = job(tmp_path, env, *args, command=(sys.executable, "-c", "print('held', flush=True); "
                                              "import time; time.sleep(60)"), wait=False)
    assert proc.stdout.readline().strip() == "held"
    return proc


# ---- CPUs --------------------------------------------------------------------------------------


def test_take_cpus_gives_free_cpus_and_frees_them_with_the_holder(tmp_path):
    cpus, fds = job_resources.take_cpus([0, 1, 2, 3], 2, tmp_path)
    assert cpus == [0, 1]
    other, other_fds = job_resources.take_cpus([0, 1, 2, 3], 2, tmp_path)
    assert other == [2, 3]  # never one another job holds
    for fd in fds:
        os.close(fd)
    again, again_fds = job_resources.take_cpus([0, 1, 2, 3], 2, tmp_path)
    assert again == [0, 1]
    for fd in other_fds + again_fds:
        os.close(fd)


def test_take_cpus_holds_none_while_it_waits(tmp_path, monkeypatch):
    cpu0, _ = job_resources.take_cpus([0], 1, tmp_path)  # another job holds CPU 0

    class Waited(Exception):
        pass

    def wait(what, waited):
        # while it waits for two, CPU 1 is not held: a job holding CPU 0 could take it
        fd = job_resources._try_lock(tmp_path / "cpu-1.lock")
        assert fd is not None
        os.close(fd)
        raise Waited(what)

    monkeypatch.setattr(job_resources, "_wait", wait)
    with pytest.raises(Waited, match="2 free CPUs of 2"):
        job_resources.take_cpus([0, 1], 2, tmp_path)


@two_cpus
def test_jobs_run_on_cpus_of_their_own(tmp_path):
    env = env_with(tmp_path, None)
    holder = holding(tmp_path, env, "--threads", "1")
    try:
        done = job(tmp_path, env, "--threads", "1")
        assert done.returncode == 0, done.stderr
        shown = json.loads(done.stdout)
        assert shown["cpus"] == shown["held"]["cpus"] == [CPUS[1]]  # the holder has CPUS[0]
        assert shown["cvd"] is None and "gpu_uuid" not in shown["held"]
    finally:
        holder.kill()
        holder.wait()
    # a killed job's locks are gone with it: both CPUs are free again
    done = job(tmp_path, env, "--threads", "2")
    assert json.loads(done.stdout)["cpus"] == CPUS[:2]


def test_more_threads_than_cpus_takes_every_cpu(tmp_path):
    done = job(tmp_path, env_with(tmp_path, None), "--threads", str(len(CPUS) + 8))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["cpus"] == CPUS


def test_the_timing_threads_probe_picks_among_the_jobs_cpus(tmp_path):
    probe = ("import json; from persistentkv.measure.host_cpu import HostPinner; "
             "p = HostPinner('fastest', log=print, probe=lambda: 1.0); cpu, _ = p.pin(); "
             "print(json.dumps({'candidates': sorted(p._saved), 'cpu': cpu}))")
    env = env_with(tmp_path, None)
    holder = holding(tmp_path, env, "--threads", "1") if len(CPUS) > 1 else None
    try:
        done = job(tmp_path, env, "--threads", "1", command=(sys.executable, "-c", probe))
    finally:
        if holder:
            holder.kill()
            holder.wait()
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["candidates"] == [shown["cpu"]] == [CPUS[-1] if holder else CPUS[0]]


# ---- GPUs --------------------------------------------------------------------------------------

A100, H200 = "NVIDIA A100-SXM4-80GB", "NVIDIA H200"
MIXED = [hardware.Gpu(0, "GPU-a", A100), hardware.Gpu(1, "GPU-b", H200), hardware.Gpu(2, "GPU-c", H200)]


def test_matching_gpus_are_those_of_the_target_and_visible():
    assert [g.index for g in job_resources.matching_gpus("nvidia-h200", MIXED, None)] == [1, 2]
    assert [g.index for g in job_resources.matching_gpus("nvidia-h200", MIXED, "2")] == [2]
    assert [g.index for g in job_resources.matching_gpus("nvidia-h200", MIXED, "GPU-c,GPU-a")] == [2]
    assert [g.index for g in job_resources.matching_gpus("nvidia-a100-sxm4-80gb", MIXED, None)] == [0]


@pytest.mark.parametrize("gpus, visible, message", [
    ([], None, "hardware.target is nvidia-h200, but .* has no GPU \\(nvidia-smi is missing or lists none\\)"),
    (MIXED, "0", f"the GPUs this job may use on .* are {A100} \\(nvidia-a100-sxm4-80gb\\): run it on a host "
                 "with nvidia-h200 GPUs"),
    (MIXED, "7", "CUDA_VISIBLE_DEVICES=7 names none of the GPUs nvidia-smi lists"),
])
def test_no_gpu_of_the_target_is_a_one_line_error(gpus, visible, message):
    with pytest.raises(PKVError, match=message):
        job_resources.matching_gpus("nvidia-h200", gpus, visible)


def test_gpu_jobs_get_different_gpus_by_uuid(tmp_path):
    env = env_with(tmp_path, [H200, H200])
    holder = holding(tmp_path, env, "--threads", "1", "--gpu", "nvidia-h200")
    try:
        done = job(tmp_path, env, "--threads", "1", "--gpu", "nvidia-h200")
    finally:
        holder.kill()
        holder.wait()
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["cvd"] == "GPU-fake-1"  # the holder has GPU 0
    assert shown["held"]["gpu_index"] == 1 and shown["held"]["gpu_uuid"] == "GPU-fake-1"
    assert shown["held"]["gpu_name"] == H200 and shown["held"]["cpus"] == shown["cpus"]


@pytest.mark.parametrize("gpus, message", [
    ([A100], "error: hardware.target is nvidia-h200, but the GPUs this job may use on"),
    (None, "error: hardware.target is nvidia-h200, but"),
])
def test_a_gpu_job_on_the_wrong_host_stops_with_one_line(tmp_path, gpus, message):
    done = job(tmp_path, env_with(tmp_path, gpus), "--threads", "1", "--gpu", "nvidia-h200")
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and done.stderr.startswith(message), done.stderr


def test_under_slurm_the_allocation_is_the_jobs(tmp_path):
    env = env_with(tmp_path, [H200, H200], SLURM_JOB_ID="42", CUDA_VISIBLE_DEVICES="1")
    done = job(tmp_path, env, "--threads", "1", "--gpu", "nvidia-h200")
    assert done.returncode == 0, done.stderr
    shown = json.loads(done.stdout)
    assert shown["cvd"] == "GPU-fake-1" and shown["held"]["gpu_index"] == 1
    assert shown["cpus"] == shown["held"]["cpus"] == CPUS  # SLURM's CPUs, not re-pinned
    assert not (tmp_path / ".snakemake" / "job_resources").exists()  # nothing locked


def test_a_missing_command_is_one_line(tmp_path):
    done = job(tmp_path, env_with(tmp_path, None), "--threads", "1", command=("no-such-command-here",))
    assert done.returncode == 2
    assert done.stderr == "error: cannot run 'no-such-command-here': No such file or directory\n"


# ---- provenance ----------------------------------------------------------------------------------


class FakeDevice:
    is_cuda, name, sm_count, l2_bytes = True, H200, 132, 50 * 2**20

    class device:  # noqa: N801 (torch.device's attribute)
        index = 0


def test_provenance_records_the_jobs_gpu_and_cpus(monkeypatch):
    asked = []
    monkeypatch.setattr(provenance, "nvidia_smi", lambda gpu=0: asked.append(gpu) or {"driver": "x"})
    monkeypatch.setattr(provenance, "torch_uuid", lambda device: "GPU-from-torch")
    monkeypatch.setenv(job_resources.RESOURCES_ENV, json.dumps({"cpus": [3, 4], "gpu_index": 1,
                                                                 "gpu_uuid": "GPU-b", "gpu_name": H200}))
    record = provenance.collect({}, [1], "2026-01-01T00:00:00Z", FakeDevice())
    assert (record["gpu_uuid"], record["gpu_index"], record["cpus"]) == ("GPU-b", 1, [3, 4])
    # torch's cuda:0 is nvidia-smi's GPU 1 here: the clocks and driver are asked of that GPU by UUID
    assert asked == ["GPU-b"] and record["driver"] == "x"
    monkeypatch.delenv(job_resources.RESOURCES_ENV)
    record = provenance.collect({}, [1], "2026-01-01T00:00:00Z", FakeDevice())
    assert (record["gpu_uuid"], record["gpu_index"], record["cpus"]) == ("GPU-from-torch", None, CPUS)
    assert asked[-1] == "GPU-from-torch"


def test_a_killed_gpu_job_frees_its_gpu(tmp_path):
    env = env_with(tmp_path, [H200])
    holder = holding(tmp_path, env, "--threads", "1", "--gpu", "nvidia-h200")
    waiting = job(tmp_path, env, "--threads", "1", "--gpu", "nvidia-h200", wait=False)
    time.sleep(1.0)
    assert waiting.poll() is None  # the only GPU is held: it waits
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    out, _ = waiting.communicate(timeout=30)
    assert waiting.returncode == 0 and json.loads(out)["cvd"] == "GPU-fake-0"
