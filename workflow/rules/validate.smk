# Our routes run by the NumPy executor at sampled steps of every trace, against float64 (CPU).


rule validate_cpu:
    input:
        traces=CALIBRATION_TRACE_FILES,
    output:
        report("results/counters/validation_cpu.parquet", caption="../report/validation_cpu.rst",
               category="Validation"),
    log:
        "logs/validate/cpu.log",
    # one worker process per thread, one sampled step each (Snakemake gives at most --cores)
    threads: 8
    params:
        config=CONFIG_FILE,
        spec=config["spec"],
        planner=config["planner"],
        validation=config["validation"]["cpu"],
        traces_dir=lambda wildcards, input: os.path.dirname(input.traces[0]),
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv validate-cpu --config {params.config} --traces-dir {params.traces_dir} --out {output}"
            " --jobs {threads} --no-progress > {log} 2>&1",
        )
