# persistentkv reproduce-check: the re-measured results folder of config reproduce.measured against
# the committed reference, results/<hardware.reference>/ as git's HEAD holds it (extracted into
# build/reproduce/committed/, so a rerun on the reference's own GPU, which rewrites
# results/<hardware.reference>/, is still compared with what was committed; outside a git checkout
# the job says how to put the tree's own results/ there instead). Not part of `all`:
# `snakemake reproduce_check --cores 1`, or, measuring first, `snakemake reproduce --configfile
# config/reproduce.yaml --cores all` (the reduced grid). Include after render.smk (RENDER_COUNTERS)
# and, with a GPU, measure.smk (MEASURE_TARGETS).

import shlex

from persistentkv.provenance import git_state
from persistentkv.reproduce import measured_folder

#: The commit whose results/ is the reference (None outside a git checkout: the extracting job says so).
REPRODUCE_COMMIT = git_state()[0]
#: reproduce.measured; auto: results/<HW>, the reference's folder when this run measures nothing.
REPRODUCE_MEASURED = str(measured_folder(config, HW)).rstrip("/")
REPRODUCE_COMMITTED = "build/reproduce/committed"
#: reproduce.reference: cut, the committed reference cut to this config's grid and judged again
#: (rule reproduce_reference), so a reduced re-measurement is compared like for like.
REPRODUCE_CUT = config["reproduce"].get("reference", "committed") == "cut"
REPRODUCE_REFERENCE = "build/reproduce/reference"


rule reproduce_committed:
    output:
        directory(f"{REPRODUCE_COMMITTED}/results"),
    log:
        "logs/reproduce/committed.log",
    params:
        commit=REPRODUCE_COMMIT or "",   # a new commit extracts again
        out_dir=lambda w, output: os.path.dirname(output[0]),
    conda:
        CONDA_ENV
    shell:
        "(test -n '{params.commit}' || {{ echo 'error: reproduce_check reads the committed results from git, "
        "and this tree is no git checkout: copy the results/ it came with to {output} before any GPU job "
        "rewrites them (mkdir -p {params.out_dir} && cp -r results {params.out_dir}/), then run it again'; "
        "exit 1; }}) > {log} 2>&1"
        " && mkdir -p {params.out_dir} && git archive --format=tar {params.commit} results"
        " | tar -x -C {params.out_dir} 2>> {log}"


rule reproduce_reference:
    """The committed reference cut to this config's grid, with its claims judged again."""
    input:
        committed=rules.reproduce_committed.output,
        config=CONFIG_FILE,
    output:
        directory(f"{REPRODUCE_REFERENCE}/{config['hardware']['reference']}"),
        directory(f"{REPRODUCE_REFERENCE}/counters"),
    log:
        "logs/reproduce/reference.log",
    params:
        reference=lambda w, input: f"{input.committed[0]}/{config['hardware']['reference']}",
    conda:
        CONDA_ENV
    shell:
        job(
            f"rm -rf {REPRODUCE_REFERENCE} && persistentkv reproduce-reference --config {{input.config}}"
            f" --reference {{params.reference}} --out {REPRODUCE_REFERENCE} > {{log}} 2>&1",
        )


rule reproduce_check:
    input:
        committed=rules.reproduce_reference.output[0] if REPRODUCE_CUT else rules.reproduce_committed.output,
        claims=f"{REPRODUCE_MEASURED}/claims.json",
        counters=RENDER_COUNTERS,
        config=CONFIG_FILE,
    output:
        f"{REPRODUCE_MEASURED}/reproduction.json",
    log:
        "logs/reproduce/check.log",
    params:
        reference=lambda w, input: input.committed if REPRODUCE_CUT
        else f"{input.committed[0]}/{config['hardware']['reference']}",
        measured=lambda w, output: os.path.dirname(output[0]),
    conda:
        CONDA_ENV
    shell:
        # --exit-zero: a reproduction that disagrees keeps its reproduction.json (Snakemake deletes
        # a failed job's outputs); the table printed here says what disagrees.
        job(
            "persistentkv reproduce-check --config {input.config} --reference {params.reference}"
            " --measured {params.measured} --out {output} --exit-zero 2>&1 | tee {log}",
        )


# The re-measurement and its check in one target: every GPU rule of this config (measure.smk's
# MEASURE_TARGETS; config/reproduce.yaml is the grid sized for it), the claims of this GPU's
# results/<HW>/ and reproduce_check on that folder. Without a GPU to measure it schedules no GPU
# job: its one job stops with one line saying why.
_target = config["hardware"]["target"]
if not HW:
    REPRODUCE_REFUSAL = (f"error: snakemake reproduce measures on a GPU, and hardware.target is {_target}"
                         + (" on a host where nvidia-smi lists none" if _target == hardware.TARGET_AUTO else "")
                         + ": run it on a GPU host, or set hardware.target to a GPU slug such as nvidia-h200")
elif REPRODUCE_MEASURED != f"results/{HW}":
    REPRODUCE_REFUSAL = (f"error: snakemake reproduce checks results/{HW}, which this run measures, but "
                         f"reproduce.measured is {REPRODUCE_MEASURED}: set it to auto")
else:
    REPRODUCE_REFUSAL = None

if REPRODUCE_REFUSAL:

    rule reproduce:
        log:
            "logs/reproduce/reproduce.log",
        conda:
            CONDA_ENV
        shell:
            # the default profile prints a failed job's log on the console
            f"echo {shlex.quote(REPRODUCE_REFUSAL)} > {{log}}; exit 1"

else:

    rule reproduce:
        input:
            MEASURE_TARGETS,
            f"results/{HW}/claims.json",
            rules.reproduce_check.output,
