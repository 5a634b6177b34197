# Names shared by the workflow's .smk files: the job prefix, the conda environment, traces and
# seeds, wildcard constraints. The Snakefile has validated the config and set CONFIG_FILE and HW
# before this file is read.

import glob
import mimetypes
import os

from persistentkv import configuration, hardware

#: The conda environment of environment.yml; declared only where the file exists (a missing one fails every job).
CONDA_ENV = "../../environment.yml" if os.path.isfile(os.path.join(workflow.basedir, "..", "environment.yml")) else None


def job(command, gpu=None, folder=None):
    """``command`` as a job's shell command: it holds {threads} CPUs of its own for its lifetime,
    so no two jobs share one, and with ``gpu`` (a results/<hw>/ name) also a GPU of that kind
    (persistentkv.job_resources). ``folder``: one the command reads and may find absent (no
    output of the job lies in it, so Snakemake does not make it), made first."""
    made = f"mkdir -p {folder} && " if folder else ""
    return f"{made}python -m persistentkv.job_resources --threads {{threads}}{f' --gpu {gpu}' if gpu else ''} -- {command}"

# `snakemake --report` embeds tables as downloads; without a type it labels parquet text/plain.
mimetypes.add_type("application/vnd.apache.parquet", ".parquet")

TRACE_NAMES = configuration.trace_names(config)
CALIBRATION_SEED = configuration.calibration_seed(config)
SEEDS = configuration.all_seeds(config)
TRACE_FILES = expand("build/traces/{trace}_s{seed}.json", trace=TRACE_NAMES, seed=SEEDS)
CALIBRATION_TRACE_FILES = expand("build/traces/{trace}_s{seed}.json", trace=TRACE_NAMES, seed=CALIBRATION_SEED)
COUNTER_FILES = expand("build/counters/{trace}_s{seed}.parquet", trace=TRACE_NAMES, seed=SEEDS)


def ablation_trace_files(kind):
    """Trace files an ablation reads: its traces at the calibration seed."""
    return expand("build/traces/{trace}_s{seed}.json", trace=config["ablations"][kind]["traces"],
                  seed=CALIBRATION_SEED)


def trace_entry(wildcards):
    """The config entry of a trace (passed as a parameter, so editing it reruns that trace's jobs)."""
    return configuration.trace_entry(config, wildcards.trace)


def trace_source(wildcards):
    """A file trace's CSV (an input: editing the file regenerates the trace); nothing otherwise."""
    entry = configuration.trace_entry(config, wildcards.trace)
    return [entry["path"]] if entry["kind"] == "file" else []


wildcard_constraints:
    trace="|".join(TRACE_NAMES),
    seed=r"\d+",


def in_report(path, suffix, **report_args):
    """``path`` as an entry of Snakemake's report (``report_args``: caption, category, ...) for
    the config's cache (``suffix`` ""); an FP8 run's table (suffix "_fp8") stays out of it."""
    return path if suffix else report(path, **report_args)
