"""A workflow job's CPUs, and a GPU job's GPU, held under locks for the job's lifetime.

    python -m persistentkv.job_resources --threads N [--gpu HW] -- COMMAND [ARGS...]

Every rule's command starts with this (workflow/rules/common.smk). Snakemake counts ``--cores``
and ``--resources gpu=N`` but does not say which CPUs or which GPU a local job may use
(snakemake issue 281), so this module:

- takes ``N`` of the CPUs this process may run on, each under a lock, and pins the job to them:
  no two jobs of the run share a CPU, and the measurement harness's timing thread, which picks
  among its process's CPUs (``measure.host_cpu``), never shares its CPU with another job;
- for a GPU job (``--gpu HW``, the rules' results folder): takes a free GPU whose name has the slug
  ``HW`` under a lock and exports ``CUDA_VISIBLE_DEVICES`` as its UUID (an index would count in
  CUDA's device order, which need not be nvidia-smi's); where no such GPU is visible it stops
  with one line;
- exports ``PERSISTENTKV_JOB_RESOURCES`` (JSON: ``cpus``, and ``gpu_index``/``gpu_uuid``/``gpu_name``),
  which the provenance of GPU runs records;
- then becomes COMMAND (exec). The locks are ``flock`` locks on files under ``.snakemake/job_resources/``
  of the working directory, whose descriptors COMMAND inherits: the kernel frees them when the
  job's process exits, however it exits, so a killed run leaves nothing to clean up.

Busy CPUs and GPUs are waited for: Snakemake starts no more GPU jobs than ``--resources gpu=N`` allows,
so a wait means another run, or N larger than the GPUs here.

Under SLURM (``SLURM_JOB_ID`` set) the allocation is the job's own: nothing is locked or pinned,
a GPU job checks the GPU the scheduler gave it (``CUDA_VISIBLE_DEVICES``), and both are recorded.
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from . import hardware
from .errors import PKVError, require

#: Lock files, one per CPU and per GPU UUID (Snakemake's own folder of the working directory).
LOCKS_DIR = Path(".snakemake") / "job_resources"
#: What the job was given, for persistentkv.provenance.
RESOURCES_ENV = "PERSISTENTKV_JOB_RESOURCES"
WAIT_S = 0.5


def _try_lock(path: Path) -> int | None:
    """An open descriptor holding an exclusive flock on ``path``, or None while another holds it."""
    fd = os.open(path, os.O_RDONLY | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _wait(what: str, waited: bool) -> bool:
    if not waited:
        print(f"job_resources: waiting for {what}", file=sys.stderr, flush=True)
    time.sleep(WAIT_S)
    return True


def take_gpu(candidates: list[hardware.Gpu], folder: Path = LOCKS_DIR) -> tuple[hardware.Gpu, int]:
    """The first of ``candidates`` no other job holds, and the descriptor of its lock (waits)."""
    folder.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        for gpu in candidates:
            fd = _try_lock(folder / f"gpu-{gpu.uuid}.lock")
            if fd is not None:
                return gpu, fd
        waited = _wait(f"one of {len(candidates)} GPUs held by other jobs", waited)


def take_cpus(allowed: list[int], count: int, folder: Path = LOCKS_DIR) -> tuple[list[int], list[int]]:
    """``count`` CPUs of ``allowed`` no other job holds (lowest first) and their lock descriptors.

    All or none: a job never holds some CPUs while it waits for more, so jobs cannot wait on each
    other in a circle."""
    folder.mkdir(parents=True, exist_ok=True)
    waited = False
    while True:
        held: dict[int, int] = {}
        for cpu in allowed:
            fd = _try_lock(folder / f"cpu-{cpu}.lock")
            if fd is not None:
                held[cpu] = fd
                if len(held) == count:
                    return sorted(held), list(held.values())
        for fd in held.values():
            os.close(fd)
        waited = _wait(f"{count} free CPUs of {len(allowed)}", waited)


def visible_gpus(gpus: list[hardware.Gpu], cuda_visible: str | None) -> list[hardware.Gpu]:
    """``gpus`` restricted to CUDA_VISIBLE_DEVICES (indices or UUIDs) where it is set."""
    if cuda_visible is None:
        return gpus
    tokens = [t.strip() for t in cuda_visible.split(",") if t.strip()]
    return [g for t in tokens for g in gpus if t in (str(g.index), g.uuid)]


def matching_gpus(hw: str, gpus: list[hardware.Gpu], cuda_visible: str | None) -> list[hardware.Gpu]:
    """The GPUs a job for results/<hw>/ may use here; a one-line PKVError where there is none."""
    host = socket.gethostname()
    require(bool(gpus), f"hardware.target is {hw}, but {host} has no GPU (nvidia-smi is missing or lists "
                        f"none): run the GPU jobs on a host with one, or set hardware.target: none")
    seen = visible_gpus(gpus, cuda_visible)
    require(bool(seen), f"CUDA_VISIBLE_DEVICES={cuda_visible} names none of the GPUs nvidia-smi lists on "
                        f"{host} ({', '.join(f'{g.index} {g.uuid}' for g in gpus)})")
    matching = [g for g in seen if hardware.slug(g.name) == hw]
    names = ", ".join(sorted({f"{g.name} ({hardware.slug(g.name)})" for g in seen}))
    require(bool(matching), f"hardware.target is {hw}, but the GPUs this job may use on {host} are {names}: "
                            f"run it on a host with {hw} GPUs, or set hardware.target to one of these slugs")
    return matching


def prepare(threads: int, hw: str | None, env: dict, folder: Path = LOCKS_DIR) -> tuple[dict, list[int]]:
    """The job's environment and the lock descriptors it must keep open; pins this process.

    ``threads``: Snakemake's count for the job; ``hw``: the results folder of a GPU job, None for a
    CPU job; ``env``: the environment to run it in (not modified)."""
    env = dict(env)
    batch = env.get("SLURM_JOB_ID") is not None
    allowed = sorted(os.sched_getaffinity(0))
    record: dict = {}
    fds: list[int] = []
    if hw is not None:
        gpus = matching_gpus(hw, hardware.gpus(), env.get("CUDA_VISIBLE_DEVICES"))
        gpu = gpus[0]
        if not batch:
            gpu, fd = take_gpu(gpus, folder)
            fds.append(fd)
        env["CUDA_VISIBLE_DEVICES"] = gpu.uuid
        record.update(gpu_index=gpu.index, gpu_uuid=gpu.uuid, gpu_name=gpu.name)
    cpus = allowed
    if not batch:
        # --cores above this host's CPUs would otherwise leave the job waiting for CPUs that do not exist
        cpus, cpu_fds = take_cpus(allowed, max(1, min(threads, len(allowed))), folder)
        fds.extend(cpu_fds)
        os.sched_setaffinity(0, cpus)
    record["cpus"] = cpus
    env[RESOURCES_ENV] = json.dumps(record, sort_keys=True)
    return env, fds


def held_resources(env=os.environ) -> dict:
    """What :func:`prepare` gave this job (``cpus``, ``gpu_*``); {} outside a workflow job."""
    text = env.get(RESOURCES_ENV)
    return json.loads(text) if text else {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m persistentkv.job_resources", description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, required=True, help="CPUs to hold (Snakemake's {threads})")
    parser.add_argument("--gpu", metavar="HW", help="a GPU job for results/HW/: hold a GPU whose slug is HW")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- COMMAND [ARGS...]")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    try:
        require(bool(command), "no command to run: python -m persistentkv.job_resources --threads N [--gpu HW] -- COMMAND")
        env, fds = prepare(args.threads, args.gpu, dict(os.environ))
        for fd in fds:
            os.set_inheritable(fd, True)
        try:
            os.execvpe(command[0], command, env)
        except OSError as exc:
            raise PKVError(f"cannot run {command[0]!r}: {exc.strerror}") from None
    except PKVError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0  # not reached: exec replaced this process


if __name__ == "__main__":
    raise SystemExit(main())
