# persistentkv reproduce-check: the re-measured results folder of config reproduce.measured against
# the committed reference, results/<hardware.reference>/ as git's HEAD holds it (extracted into
# build/reproduce/committed/, so a rerun on the reference's own GPU, which rewrites
# results/<hardware.reference>/, is still compared with what was committed). Not part of `all`:
# `snakemake reproduce_check --cores 1`. Include after render.smk (RENDER_COUNTERS).

from persistentkv.provenance import git_state

#: The commit whose results/ is the reference (None outside a git checkout: the extracting job says so).
REPRODUCE_COMMIT = git_state()[0]
REPRODUCE_MEASURED = config["reproduce"]["measured"].rstrip("/")
REPRODUCE_COMMITTED = "build/reproduce/committed"


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
        "and this tree is no git checkout'; exit 1; }}) > {log} 2>&1"
        " && mkdir -p {params.out_dir} && git archive --format=tar {params.commit} results"
        " | tar -x -C {params.out_dir} 2>> {log}"


rule reproduce_check:
    input:
        committed=rules.reproduce_committed.output,
        claims=f"{REPRODUCE_MEASURED}/claims.json",
        counters=RENDER_COUNTERS,
        config=CONFIG_FILE,
    output:
        f"{REPRODUCE_MEASURED}/reproduction.json",
    log:
        "logs/reproduce/check.log",
    params:
        reference=lambda w, input: f"{input.committed[0]}/{config['hardware']['reference']}",
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
