# Rendering: claims.json, SVG figures and the self-contained HTML report for every
# hardware under results/ (the reference hardware always, measured or not). The Snakefile includes
# this file after common.smk (CONFIG_FILE, CONDA_ENV) and adds RENDER_TARGETS to `all`.
#
# Inputs are whatever results/<hw>/ holds when the DAG is built: a hardware measured in part
# renders with "not measured on <hw> yet" where rows are missing, never with made-up numbers.

import glob
import os
from pathlib import PurePath

from persistentkv.render import FIGURE_NAMES

RENDER_CONFIG = CONFIG_FILE  # common.smk: the config file Snakemake loaded
RENDER_COUNTERS = [
    "results/counters/ablation_buckets.parquet",
    "results/counters/ablation_splits.parquet",
    "results/counters/validation_cpu.parquet",
]
#: Files of results/<hw>/ the renderers read, where present (docs/DATA.md).
RENDER_MEASURED = ["raw/*.parquet", "raw/*.json", "bench_kernels.parquet", "validation_gpu.parquet",
                   "provenance.json", "policy.json", "kernels.json"]
RENDER_MEASURED += ["bench_shapes.parquet"]  # the shapes experiment (measure.smk, rule bench_shapes)
RENDER_MEASURED += ["bench_kernels_*.parquet", "bench_shapes_*.parquet"]  # the grids per cache dtype (measure.kv_dtypes)
RENDER_MEASURED += ["e2e/*.parquet", "e2e/*.json"]  # the full decode step's passes (rule measure_e2e_pass)
# the FP8 cache's runs beyond the grids (validate_gpu_fp8, fp8_logits, measure_e2e_fp8) and the FP8
# policy's rows and fit (measure_fp8, calibrate_fp8)
RENDER_MEASURED += ["validation_gpu_fp8.parquet", "fp8_logits.parquet", "e2e_fp8/*.parquet", "raw_fp8/*.parquet",
                    "policy_fp8.json"]
#: Files the GPU rules of this run will write (measure.smk, included only when measuring).
RENDER_MEASURING = [str(t) for t in globals().get("MEASURE_TARGETS", [])]
RENDER_HWS = sorted(
    {config["hardware"]["reference"]}
    | {d for d in (os.listdir("results") if os.path.isdir("results") else [])
       if d != "counters" and os.path.isdir(os.path.join("results", d))}
    | {PurePath(t).parts[1] for t in RENDER_MEASURING if PurePath(t).parts[0] == "results"}
)
RENDER_TARGETS = expand("results/{hw}/report.html", hw=RENDER_HWS)
#: The code that turns results into claims, figures, tables and the report, where this checkout
#: has it (src/ layout): a change to it re-renders (Snakemake's own code trigger covers run: and
#: script: blocks, not shell commands).
RENDER_CODE = sorted(
    p for pattern in ("render/*.py", "render/templates/*", "claims.py", "targets.py", "targets_fp8.py", "analysis.py",
                    "results.py", "names.py")
    for p in glob.glob(f"src/persistentkv/{pattern}")
)


wildcard_constraints:
    hw="(?!counters$)[a-z0-9][a-z0-9-]*",


# The measured files of results/<hw>/ that exist now (any subset, possibly none), plus those this
# run's GPU rules will write there, so the report waits for a measurement made in the same run.
render_measured = lambda w: sorted(
    {p for pattern in RENDER_MEASURED for p in glob.glob(f"results/{w.hw}/{pattern}")}
    | {t for t in RENDER_MEASURING if t.startswith(f"results/{w.hw}/")}
)


rule render_claims:
    input:
        measured=render_measured,
        counters=RENDER_COUNTERS,
        config=RENDER_CONFIG,
        code=RENDER_CODE,
    output:
        "results/{hw}/claims.json",
    conda:
        CONDA_ENV
    log:
        "logs/render/claims_{hw}.log",
    params:
        results=lambda w: f"results/{w.hw}",
    shell:
        job(
            "persistentkv claims --results {params.results} --counters results/counters"
            " --config {input.config} --out {output} > {log} 2>&1",
        )


rule render_figures:
    input:
        measured=render_measured,
        counters=RENDER_COUNTERS,
        config=RENDER_CONFIG,
        code=RENDER_CODE,
    output:
        [
            report(f"build/figures/{{hw}}/{name}.svg", caption=f"../report/render_{name}.rst",
                   category="Figures", subcategory="{hw}")
            for name in FIGURE_NAMES
        ],
    conda:
        CONDA_ENV
    log:
        "logs/render/figures_{hw}.log",
    params:
        results=lambda w: f"results/{w.hw}",
        out_dir=lambda w, output: os.path.dirname(output[0]),
    shell:
        # the reference hardware renders before anything measured it, and nothing here makes its
        # folder (render_claims' output does, maybe later), while the command refuses an absent one
        job(
            "persistentkv figures --results {params.results} --counters results/counters"
            " --config {input.config} --format svg --out-dir {params.out_dir} > {log} 2>&1",
            folder="{params.results}",
        )


rule render_report:
    input:
        measured=render_measured,
        counters=RENDER_COUNTERS,
        config=RENDER_CONFIG,
        claims="results/{hw}/claims.json",
        figures=expand("build/figures/{{hw}}/{name}.svg", name=FIGURE_NAMES),
        code=RENDER_CODE,
        # its reproduction section, where reproduce-check has written one (reproduce.smk)
        reproduction=lambda w: glob.glob(f"results/{w.hw}/reproduction.json"),
    output:
        report("results/{hw}/report.html", caption="../report/render_report.rst", category="Report",
               subcategory="{hw}"),
    conda:
        CONDA_ENV
    log:
        "logs/render/report_{hw}.log",
    params:
        results=lambda w: f"results/{w.hw}",
        figures_dir=lambda w, input: os.path.dirname(input.figures[0]),
    shell:
        job(
            "persistentkv report --results {params.results} --counters results/counters --config {input.config}"
            " --claims {input.claims} --figures-dir {params.figures_dir} --out {output} > {log} 2>&1",
        )
