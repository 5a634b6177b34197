# Workload counters of every route for every trace and seed, and the two ablations (CPU only).


rule counter:
    input:
        "build/traces/{trace}_s{seed}.json",
    output:
        "build/counters/{trace}_s{seed}.parquet",
    log:
        "logs/counters/{trace}_s{seed}.log",
    params:
        config=CONFIG_FILE,
        spec=config["spec"],
        planner=config["planner"],
        entry=trace_entry,
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv counters --config {params.config} --trace-json {input} --out {output}"
            " --no-progress > {log} 2>&1",
        )


rule counters:
    input:
        COUNTER_FILES,


rule ablation_buckets:
    input:
        traces=ablation_trace_files("buckets"),
    output:
        table="results/counters/ablation_buckets.parquet",
        figure=report("results/counters/ablation_buckets.svg", caption="../report/ablation_buckets.rst",
                      category="Ablations (counters)"),
    log:
        "logs/ablation/buckets.log",
    params:
        config=CONFIG_FILE,
        spec=config["spec"],
        planner=config["planner"],
        ablation=config["ablations"]["buckets"],
        traces_dir=lambda wildcards, input: os.path.dirname(input.traces[0]),
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv ablation buckets --config {params.config} --traces-dir {params.traces_dir}"
            " --out {output.table} --figure {output.figure} --no-progress > {log} 2>&1",
        )


rule ablation_splits:
    input:
        traces=ablation_trace_files("splits"),
    output:
        table="results/counters/ablation_splits.parquet",
        figure=report("results/counters/ablation_splits.svg", caption="../report/ablation_splits.rst",
                      category="Ablations (counters)"),
    log:
        "logs/ablation/splits.log",
    params:
        config=CONFIG_FILE,
        spec=config["spec"],
        planner=config["planner"],
        ablation=config["ablations"]["splits"],
        traces_dir=lambda wildcards, input: os.path.dirname(input.traces[0]),
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv ablation splits --config {params.config} --traces-dir {params.traces_dir}"
            " --out {output.table} --figure {output.figure} --no-progress > {log} 2>&1",
        )
