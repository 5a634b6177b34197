"""The Snakemake workflow on a copy of the repository: dry runs with and without a GPU, one-line
errors when it loads, lint, and a small real run that is then up to date."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from workflow_support import ROOT, copy_workflow, gpu_env, job_counts, needs_snakemake, snakemake

from persistentkv import configuration, hardware
from persistentkv.errors import PKVError

CONFIG = configuration.load_config(ROOT / "config" / "config.yaml", base_dir=ROOT)
SEED = configuration.calibration_seed(CONFIG)

H200 = ["NVIDIA H200"]  # the stand-in nvidia-smi's GPUs (workflow_support.gpu_env); None: no GPU


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    return copy_workflow(tmp_path_factory.mktemp("repo"))


@needs_snakemake
def test_dry_run_all_without_gpu(repo, tmp_path):
    done = snakemake(repo, "-n", "all", env=gpu_env(tmp_path / "bin", None))
    assert done.returncode == 0, done.stderr + done.stdout
    counts = job_counts(done.stdout)
    traces, seeds = len(configuration.trace_names(CONFIG)), len(configuration.all_seeds(CONFIG))
    assert counts["trace"] == counts["counter"] == traces * seeds == 42
    for rule in ("validate_cpu", "ablation_buckets", "ablation_splits", "kernels", "all"):
        assert counts[rule] == 1, rule
    for gpu_rule in ("measure", "bench_kernels", "validate_gpu", "calibrate", "provenance"):
        assert gpu_rule not in counts


@needs_snakemake
def test_dry_run_all_with_a_gpu(repo, tmp_path):
    done = snakemake(repo, "-n", "-p", "all", env=gpu_env(tmp_path / "bin", H200))
    assert done.returncode == 0, done.stderr + done.stdout
    counts = job_counts(done.stdout)
    from persistentkv.names import EXPERIMENTS

    assert counts["measure"] == len(EXPERIMENTS) == 7
    for rule in ("bench_kernels", "bench_shapes", "validate_gpu", "calibrate", "provenance"):
        assert counts[rule] == 1, rule
    out = done.stdout
    assert "persistentkv compile-kernels --arch sm_90 --out build/kernels/report.json" in out
    assert ("persistentkv measure --config config/config.yaml --experiment calibration --traces-dir build/traces"
            " --out results/nvidia-h200/raw/calibration.parquet  >") in out
    assert ("--experiment published --traces-dir build/traces --out results/nvidia-h200/raw/published.parquet"
            " --policy results/nvidia-h200/policy.json") in out
    assert ("persistentkv calibrate --config config/config.yaml --timings results/nvidia-h200/raw/calibration.parquet"
            " --out results/nvidia-h200/policy.json") in out
    assert "persistentkv bench-kernels --config config/config.yaml --out results/nvidia-h200/bench_kernels.parquet" in out
    assert "persistentkv bench-shapes --config config/config.yaml --out results/nvidia-h200/bench_shapes.parquet" in out
    assert "results/nvidia-h200/provenance.json" in out
    # every GPU job asks for a GPU (Snakemake's gpu resource) and takes one of the target's kind
    passes = counts["measure_e2e_pass"]
    assert passes == e2e_passes(repo) and passes >= 2
    # + bench, shapes, validate, the two grids on each measure.kv_dtypes cache, and each of the full
    # decode step's passes; with an FP8 cache also validate-gpu, fp8-logits, the step's passes and the
    # FP8 policy's experiments (names.FP8_EXPERIMENTS) on it
    from persistentkv.names import FP8_EXPERIMENTS

    per_cache = 2 * len(CONFIG["measure"].get("kv_dtypes", []))
    assert counts.get("bench_kernels_fp8", 0) + counts.get("bench_shapes_fp8", 0) == per_cache
    fp8 = "float8_e4m3" in CONFIG["measure"].get("kv_dtypes", [])
    fp8_runs = 2 + passes + len(FP8_EXPERIMENTS) if fp8 else 0
    assert counts.get("validate_gpu_fp8", 0) + counts.get("fp8_logits", 0) + counts.get("measure_e2e_fp8_pass", 0) \
        + counts.get("measure_fp8", 0) == fp8_runs
    if fp8:
        assert counts["calibrate_fp8"] == 1 and counts["measure_fp8"] == len(FP8_EXPERIMENTS) == 3
        assert ("--experiment calibration --kv-dtype float8_e4m3 --traces-dir build/traces --out "
                "results/nvidia-h200/raw_fp8/calibration.parquet  >") in out
        assert ("--experiment published --kv-dtype float8_e4m3 --traces-dir build/traces --out "
                "results/nvidia-h200/raw_fp8/published.parquet --policy results/nvidia-h200/policy_fp8.json") in out
        assert ("persistentkv calibrate --config config/config.yaml --timings "
                "results/nvidia-h200/raw_fp8/calibration.parquet --out results/nvidia-h200/policy_fp8.json") in out
    gpu_jobs = counts["measure"] + 3 + per_cache + passes + fp8_runs
    assert out.count("--gpu nvidia-h200 -- persistentkv ") == gpu_jobs
    assert out.count("gpu=1") == gpu_jobs
    one = snakemake(repo, "-n", "measure_published", env=gpu_env(tmp_path / "bin", H200))
    assert one.returncode == 0 and job_counts(one.stdout)["measure"] == 2  # calibration feeds the policy


def e2e_passes(repo) -> int:
    """measure.e2e_passes of the repository's config (the passes `all` asks for)."""
    return int(yaml.safe_load((repo / "config" / "config.yaml").read_text())["measure"]["e2e_passes"])


@needs_snakemake
def test_the_full_decode_step_is_a_gpu_job_of_all_and_the_report_waits_for_it(repo, tmp_path):
    """hardware.target names the GPU: each of measure-e2e's passes is in the DAG of `all` on a host
    without one, a GPU job writing results/<hw>/e2e/pass<N>.{parquet,json} (not under raw/), and
    the provenance and the rendering of that hardware read what they write."""
    copy = edited_copy(repo, tmp_path, "target: auto", "target: nvidia-h200")
    done = snakemake(copy, "-n", "-p", "all", env=gpu_env(tmp_path / "bin", None))
    assert done.returncode == 0, done.stderr + done.stdout
    passes = e2e_passes(repo)
    assert job_counts(done.stdout)["measure_e2e_pass"] == passes
    blocks = done.stdout.split("\nrule ")[1:]
    e2e = [b for b in blocks if b.startswith("measure_e2e_pass:")]
    jobs = {block.split(":", 1)[0]: block for block in blocks}
    for n in range(1, passes + 1):
        (mine,) = [b for b in e2e if f"e2e/pass{n}.parquet" in b]
        assert f"output: results/nvidia-h200/e2e/pass{n}.parquet, results/nvidia-h200/e2e/pass{n}.json" in mine
        assert f"log: logs/measure/nvidia-h200/e2e_pass{n}.log" in mine and "gpu=1" in mine
        assert ("--gpu nvidia-h200 -- persistentkv measure-e2e --config config/config.yaml"
                f" --out results/nvidia-h200/e2e/pass{n}.parquet > logs/measure/nvidia-h200/e2e_pass{n}.log") in mine
        assert f"results/nvidia-h200/e2e/pass{n}.json" in jobs["provenance"].split("output:")[0]
        for rule in ("render_claims", "render_figures", "render_report"):
            inputs = next(b for name, b in jobs.items() if name == rule and "nvidia-h200" in b).split("output:")[0]
            assert f"results/nvidia-h200/e2e/pass{n}.parquet" in inputs, rule
    # the rule by name runs every pass; one pass is its file
    named = snakemake(copy, "-n", "measure_e2e", env=gpu_env(tmp_path / "bin", None))
    assert named.returncode == 0 and job_counts(named.stdout)["measure_e2e_pass"] == passes
    one = snakemake(copy, "-n", "results/nvidia-h200/e2e/pass2.parquet", env=gpu_env(tmp_path / "bin", None))
    assert one.returncode == 0 and job_counts(one.stdout)["measure_e2e_pass"] == 1


@needs_snakemake
def test_lint_is_clean(repo, tmp_path):
    for gpus in (None, H200):
        done = snakemake(repo, "--lint", env=gpu_env(tmp_path / "bin", gpus))
        assert done.returncode == 0, done.stdout + done.stderr
        assert "Congratulations, your workflow is in a good condition!" in done.stdout + done.stderr


@needs_snakemake
def test_auto_is_refused_where_a_cluster_job_reads_the_workflow_again(repo, tmp_path):
    done = snakemake(repo, "-n", "--mode", "remote", "all", env=gpu_env(tmp_path / "bin", H200))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(
        "error: hardware.target is auto, which names the GPU of the host reading the workflow"), done.stderr


def edited_copy(repo: Path, tmp_path: Path, old: str, new: str) -> Path:
    copy = tmp_path / "edited"
    shutil.copytree(repo, copy, ignore=shutil.ignore_patterns(".snakemake"))
    path = copy / "config" / "config.yaml"
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    return copy


@needs_snakemake
@pytest.mark.parametrize("old, new, message", [
    ("max_active: 8, num_steps: 48, splits: 20}", "max_active: 0, num_steps: 48, splits: 20}",
     "error: config: traces[1].max_active: 0 is less than the minimum of 1"),
    ("  page_size: 16\n", "  page_size: 16\n  colour: blue\n", "error: config: spec: unknown key 'colour'"),
    ("target: auto", "target: NVIDIA H200", "error: config: hardware.target: 'NVIDIA H200' does not match"),
])
def test_workflow_load_errors_are_one_line(repo, tmp_path, old, new, message):
    copy = edited_copy(repo, tmp_path, old, new)
    done = snakemake(copy, "-n", "all", env=gpu_env(tmp_path / "bin", None))
    assert done.returncode != 0
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith(message), done.stderr
    assert "Traceback" not in done.stderr


@needs_snakemake
def test_config_overrides_the_commands_would_miss_are_refused(repo, tmp_path):
    done = snakemake(repo, "-n", "all", "--config", "planner={target_items: 100, min_chunk_tiles: 1}",
                     env=gpu_env(tmp_path / "bin", None))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith("error: config: planner.target_items:")
    partial = tmp_path / "partial.yaml"
    partial.write_text("planner: {target_items: 100, min_chunk_tiles: 1}\n")
    done = snakemake(repo, "-n", "all", "--configfile", str(partial), env=gpu_env(tmp_path / "bin", None))
    assert done.returncode != 0
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: config: spec differs from {partial}")


@needs_snakemake
def test_small_run_then_nothing_to_do(repo, tmp_path):
    env = gpu_env(tmp_path / "bin", None)
    target = f"build/counters/bimodal_b4_s{SEED}.parquet"
    done = snakemake(repo, "--cores", "1", target, env=env)
    assert done.returncode == 0, done.stderr
    assert (repo / target).is_file() and (repo / f"build/traces/bimodal_b4_s{SEED}.json").is_file()
    assert (repo / f"logs/counters/bimodal_b4_s{SEED}.log").is_file()
    again = snakemake(repo, "-n", target, env=env)
    assert again.returncode == 0 and "Nothing to be done" in again.stdout + again.stderr


# ---- hardware: the decisions the Snakefile takes as it loads ------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("NVIDIA H200", "nvidia-h200"), ("NVIDIA GeForce RTX 3060", "nvidia-geforce-rtx-3060"),
    ("  NVIDIA A100-SXM4-80GB ", "nvidia-a100-sxm4-80gb"), ("H100 (PCIe)", "h100-pcie")])
def test_slug(name, expected):
    assert hardware.slug(name) == expected


def test_slug_of_nothing_is_an_error():
    with pytest.raises(PKVError, match="has no letters or digits"):
        hardware.slug(" -- ")


@pytest.mark.parametrize("gpus, gpu, arch", [(H200, "NVIDIA H200", "sm_90"), (None, None, None)])
def test_detect_gpu_and_targets(tmp_path, monkeypatch, gpus, gpu, arch):
    monkeypatch.setenv("PATH", gpu_env(tmp_path / "bin", gpus)["PATH"])
    assert hardware.detect_gpu() == gpu
    assert hardware.detect_arch() == arch
    config = lambda target: {"hardware": {"target": target, "kernel_archs": ["sm_80"]}}
    assert hardware.target(config("none")) is None
    assert hardware.target(config("auto")) == (hardware.slug(gpu) if gpu else None)
    assert hardware.target(config("nvidia-a100-sxm4-80gb")) == "nvidia-a100-sxm4-80gb"  # whatever is here
    hw = hardware.target(config("auto"))
    assert hardware.kernel_archs(config("auto"), hw) == ([arch] if arch else ["sm_80"])
    assert hardware.kernel_archs(config("nvidia-h200"), "nvidia-h200") == ["sm_80"]  # a named target probes nothing


def test_no_nvidia_smi_means_no_gpu(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty folder: nvidia-smi is not found
    assert hardware.detect_gpu() is None and hardware.detect_arch() is None


# ---- provenance: the sidecars of one hardware merged ---------------------------------------------

def merge_provenance(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "workflow" / "scripts" / "merge_provenance.py"), *map(str, args)],
                          capture_output=True, text=True, timeout=60)


def test_merge_provenance(tmp_path):
    import json

    a, b = tmp_path / "published.json", tmp_path / "bench_kernels.json"
    a.write_text(json.dumps({"published-1": {"gpu": "NVIDIA H200", "seeds": [1, 2]}}))
    b.write_text(json.dumps({"bench-1": {"gpu": "NVIDIA H200"}, "published-1": {"gpu": "NVIDIA H200", "seeds": [1, 2]}}))
    out = tmp_path / "hw" / "provenance.json"
    done = merge_provenance("--out", out, a, b)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text()) == {"bench-1": {"gpu": "NVIDIA H200"},
                                           "published-1": {"gpu": "NVIDIA H200", "seeds": [1, 2]}}
    b.write_text(json.dumps({"published-1": {"gpu": "NVIDIA A100"}}))  # one id, two different runs
    out.unlink()
    done = merge_provenance("--out", out, a, b)
    assert done.returncode == 2 and not out.exists()
    assert done.stderr.count("\n") == 1 and "run id 'published-1' has different records" in done.stderr
    b.write_text("[1, 2")
    done = merge_provenance("--out", out, a, b)
    assert done.returncode == 2 and "not valid JSON" in done.stderr and not out.exists()


@pytest.mark.parametrize("hw_dir", sorted(p.parent for p in (ROOT / "results").glob("*/provenance.json")),
                         ids=lambda p: p.name)
def test_committed_provenance_is_the_merge_of_the_committed_sidecars(hw_dir, tmp_path):
    """results/<hw>/provenance.json (rule provenance) holds exactly the runs whose sidecars are
    committed beside it: a GPU run that replaced a sidecar without the merge leaves the report and
    the paper naming a run whose rows are gone."""
    import json

    from persistentkv.results import sidecar_paths

    sidecars = sidecar_paths(hw_dir)
    assert sidecars
    annotations = hw_dir / "run_commits.json"
    out = tmp_path / "provenance.json"
    done = merge_provenance("--out", out, *(["--annotations", annotations] if annotations.is_file() else []),
                            *sidecars)
    assert done.returncode == 0, done.stderr
    merged = json.loads(out.read_text())
    committed = json.loads((hw_dir / "provenance.json").read_text())
    stale, missing = sorted(set(committed) - set(merged)), sorted(set(merged) - set(committed))
    assert not stale and not missing, (
        f"{hw_dir / 'provenance.json'} is not the merge of its sidecars (runs no sidecar holds: {stale}; runs it "
        f"lacks: {missing}): rerun rule provenance (python workflow/scripts/merge_provenance.py --out "
        f"{hw_dir / 'provenance.json'} SIDECAR.json...)")
    assert committed == merged


def test_merge_provenance_annotations_fill_or_correct_commits(tmp_path):
    import json

    sidecar = tmp_path / "published.json"
    sidecar.write_text(json.dumps({"a": {"git_commit": None, "git_dirty": None},
                                   "b": {"git_commit": "1" * 40, "git_dirty": True},
                                   "c": {"git_commit": "2" * 40, "git_dirty": False}}))
    notes = tmp_path / "run_commits.json"
    notes.write_text(json.dumps({
        "a": {"git_commit": "3" * 40, "git_dirty": False, "note": "no .git"},
        "b": {"git_commit": "4" * 40, "git_dirty": False, "note": "stale .git",
              "corrects": {"git_commit": "1" * 40, "git_dirty": True}},
        "c": {"git_commit": "5" * 40, "git_dirty": False}}))
    out = tmp_path / "provenance.json"
    done = merge_provenance("--out", out, "--annotations", notes, sidecar)
    assert done.returncode == 0, done.stderr
    merged = json.loads(out.read_text())
    assert merged["a"]["git_commit"] == "3" * 40 and merged["a"]["git_source"] == "annotation"
    assert merged["b"]["git_commit"] == "4" * 40 and merged["b"]["git_note"] == "stale .git"
    assert merged["b"]["git_recorded"] == {"git_commit": "1" * 40, "git_dirty": True}
    assert merged["c"]["git_commit"] == "2" * 40 and "git_source" not in merged["c"]  # the sidecar wins
    notes.write_text(json.dumps({"c": {"git_commit": "5" * 40, "corrects": {"git_commit": "9" * 40, "git_dirty": False}}}))
    out.unlink()
    done = merge_provenance("--out", out, "--annotations", notes, sidecar)
    assert done.returncode == 2 and not out.exists() and "c corrects" in done.stderr
