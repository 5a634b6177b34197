# Our routes run by the NumPy executor at sampled steps of every trace, against float64 (CPU).


rule validate_cpu:
    input:
        traces=CALIBRATION_TRACE_FILES,
    output:
        report("results/counters/validation_cpu.parquet", caption="../report/validation_cpu.rst",
               category="Validation"),
    log:
        "logs/validate/cpu.log",
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
            " --no-progress > {log} 2>&1",
        )
