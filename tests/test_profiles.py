"""The workflow run through its profiles as a user runs it, on a small grid: GPU jobs side by side
on fake GPUs (workflow/profiles/gpus), the DAG of a named GPU target on a host without one, runs
interrupted by Ctrl-C and by a kill, a failed job's one line on the console, `--report`, and every
`snakemake` command docs/WORKFLOW.md gives."""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
from workflow_support import (ROOT, SMALL_E2E_PASSES, copy_workflow, failure, fake_calls, fake_gpu_env,
                              job_counts, needs_snakemake, small_config, snakemake)

from persistentkv import configuration
from persistentkv.names import EXPERIMENTS, FP8_EXPERIMENTS
from persistentkv.render import FIGURE_NAMES

pytestmark = [needs_snakemake, pytest.mark.slow]

GPU_RULES = {"measure": len(EXPERIMENTS), "bench_kernels": 1, "bench_shapes": 1, "validate_gpu": 1, "calibrate": 1, "provenance": 1,
             "kernels_report": 1, "measure_e2e_pass": SMALL_E2E_PASSES,
             "bench_kernels_fp8": 1, "bench_shapes_fp8": 1,   # the grids on the config's one other cache dtype
             "validate_gpu_fp8": 1, "fp8_logits": 1, "measure_e2e_fp8_pass": SMALL_E2E_PASSES,   # and its runs
             "measure_fp8": len(FP8_EXPERIMENTS), "calibrate_fp8": 1}   # and its policy's
H200 = "NVIDIA H200"


def small_repo(tmp_path: Path, **hardware) -> tuple[Path, dict]:
    repo = copy_workflow(tmp_path / "repo")
    return repo, small_config(repo, **hardware)


def overlap(a: dict, b: dict) -> bool:
    return a["start"] < b["end"] and b["start"] < a["end"]


# ---- several GPUs of one host ---------------------------------------------------------------------


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="two GPU jobs at once need two CPUs here")
def test_gpus_profile_runs_gpu_jobs_side_by_side_on_gpus_and_cpus_of_their_own(tmp_path):
    repo, _ = small_repo(tmp_path, target="nvidia-h200", gpu_job_threads=1)
    env = fake_gpu_env(tmp_path, [H200, H200], PKV_FAKE_SLEEP=2, PKV_FAKE_FAIL="--experiment fragmented")
    done = snakemake(repo, "results/nvidia-h200/provenance.json", "--workflow-profile", "workflow/profiles/gpus",
                     "--resources", "gpu=2", env=env)
    # the failed measurement stops the run's result, not the other jobs (keep-going)
    assert done.returncode != 0
    assert "error: --experiment fragmented failed on purpose" in done.stderr  # its one line, on the console
    raw = repo / "results" / "nvidia-h200" / "raw"
    assert sorted(p.stem for p in raw.glob("*.json")) == sorted(set(EXPERIMENTS) - {"fragmented"})
    assert not (raw / "fragmented.parquet").exists() and not (repo / "results/nvidia-h200/provenance.json").exists()
    calls = fake_calls(tmp_path)
    gpu_calls = [c for c in calls if c["held"].get("gpu_uuid")]
    # every measurement but the failed one, bench and its FP8 twin, validate and each of the full decode
    # step's passes, each on both caches (the stand-in fakes bench-kernels, not bench-shapes nor fp8-logits),
    # and the FP8 policy's measurements
    assert len(gpu_calls) == len(EXPERIMENTS) - 1 + 3 + SMALL_E2E_PASSES + 1 + SMALL_E2E_PASSES + len(FP8_EXPERIMENTS)
    assert all(c["cuda_visible_devices"] == c["held"]["gpu_uuid"] and c["cpus"] == c["held"]["cpus"]
               for c in gpu_calls)
    side_by_side = [(a, b) for a, b in itertools.combinations(gpu_calls, 2) if overlap(a, b)]
    assert side_by_side, "no two GPU jobs ran at the same time"
    for a, b in itertools.combinations(calls, 2):  # GPU jobs and the faked CPU jobs alike
        if overlap(a, b):
            assert not set(a["cpus"]) & set(b["cpus"]), (a, b)
            assert a["cuda_visible_devices"] is None or a["cuda_visible_devices"] != b["cuda_visible_devices"]


def test_a_named_target_lists_every_gpu_job_on_a_host_without_one(tmp_path):
    repo, _ = small_repo(tmp_path, target="nvidia-h200")
    probes = tmp_path / "nvidia-smi.calls"
    env = fake_gpu_env(tmp_path, None)
    (tmp_path / "bin" / "nvidia-smi").write_text(f'#!/bin/sh\necho "$*" >> "{probes}"\nexit 9\n')
    done = snakemake(repo, "-n", "-p", "all", env=env)
    assert done.returncode == 0, done.stderr
    counts = job_counts(done.stdout)
    assert {rule: counts.get(rule) for rule in GPU_RULES} == GPU_RULES
    # bench, shapes, validate, their three FP8 twins, fp8-logits, each of the full decode step's
    # passes on both caches, and the FP8 policy's measurements
    assert done.stdout.count("--gpu nvidia-h200 -- persistentkv ") == \
        len(EXPERIMENTS) + 7 + 2 * SMALL_E2E_PASSES + len(FP8_EXPERIMENTS)
    assert not probes.exists()  # nothing asked this host for a GPU
    for target in ("none", "auto"):
        small_config(repo, target=target)
        done = snakemake(repo, "-n", "all", env=env)
        assert done.returncode == 0 and not set(GPU_RULES) & set(job_counts(done.stdout)), done.stderr
        assert probes.exists() == (target == "auto")


# ---- interrupted runs (default profile) -----------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "kill"])
def test_an_interrupted_run_goes_on_with_the_documented_commands(tmp_path, sig):
    repo, _ = small_repo(tmp_path, target="nvidia-h200")
    env = fake_gpu_env(tmp_path, [H200], PKV_FAKE_SLEEP=8)
    table = repo / "results" / "nvidia-h200" / "raw" / "calibration.parquet"
    # a session of its own, as a terminal runs it: Ctrl-C reaches snakemake and its jobs
    run = subprocess.Popen([sys.executable, "-m", "snakemake", "measure_calibration", "--cores", "1"], cwd=repo,
                           env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        while not table.exists():  # the job wrote one of its two outputs
            assert run.poll() is None and time.monotonic() < deadline, "the measurement never started"
            time.sleep(0.1)
        os.killpg(run.pid, sig)
        run.wait(timeout=60)
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
    again = snakemake(repo, "measure_calibration", "--cores", "1", env={**env, "PKV_FAKE_SLEEP": "0"})
    if sig == signal.SIGKILL:
        assert again.returncode != 0 and "LockException" in again.stderr and "--unlock" in again.stderr
        unlock = snakemake(repo, "--unlock", env=env)
        assert unlock.returncode == 0, unlock.stderr
        again = snakemake(repo, "measure_calibration", "--cores", "1", env={**env, "PKV_FAKE_SLEEP": "0"})
    assert again.returncode == 0, again.stderr
    assert table.with_suffix(".json").is_file()  # the stopped job ran again, whole


# ---- a failed job's reason on the console -------------------------------------------------------


def test_a_failed_jobs_one_line_reaches_the_console(tmp_path):
    repo, config = small_repo(tmp_path, target="none")
    csv = repo / "config" / "tiny_trace.csv"
    csv.write_text(csv.read_text().replace("1,0,900,4", "1,0,abc,4"))
    seed = configuration.calibration_seed(config)
    done = snakemake(repo, f"build/traces/tiny_s{seed}.json", "--cores", "1", env=fake_gpu_env(tmp_path, None))
    assert done.returncode != 0
    line = "error: config/tiny_trace.csv:3: column prompt_len must be an integer, got 'abc'"
    assert (repo / f"logs/traces/tiny_s{seed}.log").read_text() == line + "\n"
    assert line in done.stderr.splitlines(), done.stderr


def test_a_stopped_e2e_pass_kept_as_docs_data_says(tmp_path):
    """docs/DATA.md: Snakemake deletes a failed job's outputs, --keep-incomplete keeps a stopped
    measure-e2e pass (its rows so far); Snakemake then counts the job as done, and --forcerun runs
    it again."""
    def passes():
        return [c for c in fake_calls(tmp_path) if c["command"] == "measure-e2e"]

    repo, _ = small_repo(tmp_path, target="nvidia-h200")
    env = fake_gpu_env(tmp_path, [H200], PKV_FAKE_STOP="measure-e2e")
    table = repo / "results" / "nvidia-h200" / "e2e" / "pass1.parquet"
    target = str(table.relative_to(repo))
    deleted = snakemake(repo, target, "--cores", "1", env=env)
    assert deleted.returncode != 0 and "stopped on purpose after writing" in deleted.stderr, deleted.stderr
    assert not table.exists()
    kept = snakemake(repo, target, "--cores", "1", "--keep-incomplete", env=env)
    assert kept.returncode != 0 and table.read_text() == "fake\n" and table.with_suffix(".json").is_file()
    env["PKV_FAKE_STOP"] = ""
    assert snakemake(repo, target, "--cores", "1", env=env).returncode == 0
    assert not passes()  # counted as done: not run again
    again = snakemake(repo, target, "--cores", "1", "--forcerun", "measure_e2e_pass", env=env)
    assert again.returncode == 0, again.stderr
    assert [c["out"] for c in passes()] == [target]


def test_the_figures_render_for_a_reference_nothing_measured_yet(tmp_path):
    """A copy without results/: the reference hardware's figures (SVG and the paper's PDF), asked
    for alone, render "not measured" panels, though no job has made results/<reference>/ (in `all`,
    render_claims makes it, in whichever order the scheduler runs the two)."""
    repo, config = small_repo(tmp_path, target="none")
    hw = config["hardware"]["reference"]
    assert not (repo / "results").exists()
    figures = [f"build/figures/{hw}/{FIGURE_NAMES[0]}.svg", f"paper/generated/figures/{FIGURE_NAMES[0]}.pdf"]
    done = snakemake(repo, *figures, "--cores", "1", env=fake_gpu_env(tmp_path, None))
    assert done.returncode == 0, failure(done, repo)
    for name in FIGURE_NAMES:
        assert (repo / "build" / "figures" / hw / f"{name}.svg").stat().st_size > 0, name
        assert (repo / "paper" / "generated" / "figures" / f"{name}.pdf").stat().st_size > 0, name
    assert f"not measured on {hw} yet" in (repo / "build" / "figures" / hw / "engine.svg").read_text()
    assert not (repo / "results" / hw / "claims.json").exists()


def test_kernels_report_never_shows_a_partial_file(tmp_path):
    repo, _ = small_repo(tmp_path, target="nvidia-h200")
    env = fake_gpu_env(tmp_path, [H200])
    done = snakemake(repo, "build/kernels/report.json", "--cores", "1", env=env)
    assert done.returncode == 0, done.stderr
    source, target = repo / "build" / "kernels" / "report.json", repo / "results" / "nvidia-h200" / "kernels.json"
    source.unlink()
    os.mkfifo(source)  # the copy blocks on reading it until the test writes
    copy = subprocess.Popen([sys.executable, "-m", "snakemake", str(target.relative_to(repo)), "--cores", "1"],
                            cwd=repo, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        log = repo / "logs" / "measure" / "nvidia-h200" / "kernels_report.log"
        deadline = time.monotonic() + 120
        while not log.exists():  # the job has started
            assert copy.poll() is None and time.monotonic() < deadline, copy.stderr.read()
            time.sleep(0.1)
        while True:  # until the copy opens its source (a FIFO without a reader refuses a writer)
            assert copy.poll() is None and time.monotonic() < deadline, copy.stderr.read()
            try:
                fifo = os.open(source, os.O_WRONLY | os.O_NONBLOCK)
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)
        assert not target.exists()  # nothing under the final name while the copy is under way
        os.write(fifo, b'{"arch": "sm_90"}\n')
        os.close(fifo)
        assert copy.wait(timeout=120) == 0, copy.stderr.read()
    finally:
        if copy.poll() is None:
            copy.kill()
    assert target.read_text() == '{"arch": "sm_90"}\n'


# ---- a small grid built once: --report and the documented commands -------------------------------


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> tuple[Path, dict]:
    """A small grid's `all`, built by `snakemake --cores 2 all` without a GPU (hardware.target: none)."""
    tmp_path = tmp_path_factory.mktemp("built")
    repo, _ = small_repo(tmp_path, target="none")
    # a clone without a GPU renders the committed reference measurements (hardware.reference)
    shutil.copytree(ROOT / "results" / "nvidia-h200", repo / "results" / "nvidia-h200")
    env = fake_gpu_env(tmp_path, None)  # the compile is faked: CI has no nvcc, and it is slow where there is one
    done = snakemake(repo, "all", "--cores", "2", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return repo, env


def test_report_holds_every_report_output(built):
    repo, env = built
    done = snakemake(repo, "--report", "report.html", env=env)
    assert done.returncode == 0, done.stderr
    expected = (["results/counters/validation_cpu.parquet", "results/counters/ablation_buckets.svg",
                 "results/counters/ablation_splits.svg", "results/nvidia-h200/report.html",
                 "paper/generated/macros.tex"]
                + [f"build/figures/nvidia-h200/{name}.svg" for name in FIGURE_NAMES]
                + [f"paper/generated/figures/{name}.pdf" for name in FIGURE_NAMES])
    added = re.findall(r"^Adding (\S+) \(", done.stderr, re.MULTILINE)
    assert sorted(added) == sorted(Path(p).name for p in expected)
    html = (repo / "report.html").read_text()
    for path in expected:
        assert Path(path).name in html, path


def test_reproduce_check_compares_with_what_git_holds(built, tmp_path):
    """reproduce_check on a checkout of the built grid: the committed results, extracted from git,
    against results/ as they lie; a counters table changed after the commit is the one disagreement."""
    source, env = built
    repo = tmp_path / "checkout"
    shutil.copytree(source, repo, ignore=shutil.ignore_patterns(".snakemake"))
    git = lambda *args: subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                                       capture_output=True, text=True, check=True)
    git("init", "-q")
    git("add", "-A")
    git("commit", "-q", "-m", "built")
    done = snakemake(repo, "reproduce_check", "--cores", "1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((repo / "results" / "nvidia-h200" / "reproduction.json").read_text())
    assert payload["agrees"] and payload["counts"]["judged"] > 10
    assert payload["reference"]["folder"] == "build/reproduce/committed/results/nvidia-h200"

    table = repo / "results" / "counters" / "ablation_splits.parquet"
    frame = pd.read_parquet(table)
    frame.loc[0, "launches"] += 1
    frame.to_parquet(table, index=False)
    done = snakemake(repo, "reproduce_check", "--cores", "1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]     # the rule keeps the file and leaves the verdict to it
    assert "counters/ablation_splits.parquet" in done.stdout + done.stderr
    payload = json.loads((repo / "results" / "nvidia-h200" / "reproduction.json").read_text())
    assert payload["disagree"] == ["counters/ablation_splits.parquet"]


def test_reproduce_check_outside_a_git_checkout_says_how_and_reads_the_copy(built, tmp_path):
    """No git: one line that says where to copy the tree's results/; after that copy the check runs."""
    source, env = built
    repo = tmp_path / "archive"
    shutil.copytree(source, repo, ignore=shutil.ignore_patterns(".snakemake", ".git"))
    done = snakemake(repo, "reproduce_check", "--cores", "1", env=env)
    assert done.returncode != 0
    log = (repo / "logs" / "reproduce" / "committed.log").read_text().strip()
    assert log == ("error: reproduce_check reads the committed results from git, and this tree is no git "
                   "checkout: copy the results/ it came with to build/reproduce/committed/results before any "
                   "GPU job rewrites them (mkdir -p build/reproduce/committed && cp -r results "
                   "build/reproduce/committed/), then run it again")
    subprocess.run("mkdir -p build/reproduce/committed && cp -r results build/reproduce/committed/", shell=True,
                   cwd=repo, check=True)
    done = snakemake(repo, "reproduce_check", "--cores", "1", env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    payload = json.loads((repo / "results" / "nvidia-h200" / "reproduction.json").read_text())
    assert payload["agrees"] and payload["reference"]["folder"] == "build/reproduce/committed/results/nvidia-h200"


#: Every `snakemake` command of docs/WORKFLOW.md and what its dry run must list: a job count per
#: rule ({}: nothing to do), on the small grid built without a GPU ("built"), on a fresh copy
#: whose hardware.target is nvidia-h200 ("gpu"), or on such a copy with the committed policy
#: ("gpu+policy").
GPU_ALL = {"trace": 4, "counter": 4, "validate_cpu": 1, "ablation_buckets": 1, "ablation_splits": 1, "kernels": 1,
           **GPU_RULES, "render_claims": 1, "render_figures": 1, "render_report": 1, "paper_tables": 1,
           "paper_figures": 1, "all": 1}
DOCUMENTED = {
    "snakemake --cores 1 all": ("built", {}),
    "snakemake -n all": ("built", {}),
    "snakemake --report report.html": ("report", None),  # test_report_holds_every_report_output
    "snakemake ablation_buckets --cores 1": ("built", {}),
    "snakemake ablation_splits --cores 1 --force": ("built", {"ablation_splits": 1}),
    "snakemake counters --cores 1 --forcerun counter": ("built", {"counter": 4, "counters": 1}),
    "snakemake --cores 1 --forcerun ablation_splits ablation_splits": ("built", "all"),  # the pitfall it names
    "snakemake --unlock": ("unlock", None),
    "snakemake all --cores 1": ("built", {}),
    "snakemake all --cores all": ("gpu", GPU_ALL),
    "snakemake bench_kernels_fp8 bench_shapes_fp8 --cores all": ("gpu", {"kernels": 1, "bench_kernels_fp8": 1,
                                                                         "bench_shapes_fp8": 1}),
    "snakemake validate_gpu_fp8 measure_e2e_fp8 fp8_logits --cores all": (
        "gpu", {"trace": 4, "kernels": 1, "measure": 1, "calibrate": 1, "validate_gpu_fp8": 1,
                "measure_e2e_fp8_pass": SMALL_E2E_PASSES, "measure_e2e_fp8": 1, "fp8_logits": 1}),
    # the committed policy kept: only the traces, the kernels and the target run (no measure, no calibrate)
    "snakemake validate_gpu_fp8 --cores all --allowed-rules trace kernels validate_gpu_fp8": (
        "gpu+policy", {"trace": 4, "kernels": 1, "validate_gpu_fp8": 1}),
    "snakemake measure_published --cores all": ("gpu", {"trace": 4, "kernels": 1, "measure": 2, "calibrate": 1,
                                                        "measure_published": 1}),
    "snakemake all --workflow-profile workflow/profiles/gpus --resources gpu=4": ("gpu", GPU_ALL),
    "snakemake all --workflow-profile workflow/profiles/slurm": ("gpu", GPU_ALL),
    # the committed results extracted from git, then the check (the copy is no checkout: the dry run plans both)
    "snakemake reproduce_check --cores 1": ("built", {"reproduce_committed": 1, "reproduce_check": 1}),
    # no GPU here (hardware.target auto in config/reproduce.yaml): its one job says so and measures nothing
    # (tests/test_reproduce_grid.py runs it, and plans it with a GPU target)
    "snakemake reproduce --configfile config/reproduce.yaml --cores all": ("built", {"reproduce": 1}),
}


def documented_commands() -> list[str]:
    text = (ROOT / "docs" / "WORKFLOW.md").read_text()
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, re.DOTALL):
        for line in block.splitlines():
            line = line.split("  #")[0].strip()
            if line.startswith("snakemake "):
                commands.append(line)
    commands += re.findall(r"`(snakemake [^`]+)`", text)  # and those the prose quotes
    return sorted(set(commands))


def test_every_documented_command_has_an_expected_dry_run():
    assert documented_commands() == sorted(DOCUMENTED)


def test_documented_commands_do_what_they_say(built, tmp_path):
    repo, env = built
    gpu_repo, _ = small_repo(tmp_path, target="nvidia-h200")
    policy_repo, _ = small_repo(tmp_path / "policy", target="nvidia-h200")
    (policy_repo / "results" / "nvidia-h200").mkdir(parents=True)
    shutil.copy(ROOT / "results" / "nvidia-h200" / "policy.json", policy_repo / "results" / "nvidia-h200")
    repos = {"built": repo, "gpu": gpu_repo, "gpu+policy": policy_repo}
    for command, (where, expected) in DOCUMENTED.items():
        if where in ("report", "unlock"):
            continue
        args = command.split()[1:]
        done = snakemake(repos[where], "-n", *args, env=env)
        assert done.returncode == 0, (command, done.stderr[-2000:])
        counts = job_counts(done.stdout)
        if expected == "all":
            assert counts.get("all") == 1 and counts.get("ablation_splits") == 1, (command, counts)
        else:
            assert counts == ({**expected, "total": sum(expected.values())} if expected else {}), (command, counts)
