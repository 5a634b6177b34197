# Traces: every config trace at the calibration and holdout seeds, as canonical JSON.


rule trace:
    input:
        trace_source,
    output:
        "build/traces/{trace}_s{seed}.json",
    log:
        "logs/traces/{trace}_s{seed}.log",
    params:
        config=CONFIG_FILE,
        entry=trace_entry,
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv traces --config {params.config} --trace {wildcards.trace} --seed {wildcards.seed}"
            " --out {output} > {log} 2>&1",
        )


rule traces:
    input:
        TRACE_FILES,
