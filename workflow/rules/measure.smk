import os

# GPU rules, included when the Snakefile has a results folder to measure into (HW, from
# hardware.target). Everything lands in results/<HW>/, never in another hardware's folder.
# A GPU job declares gpu=1 (`--resources gpu=N` runs N at once; SLURM gets --gpus=1) and
# hardware.gpu_job_threads CPUs; job(..., gpu=HW) gives it a GPU of that name and CPUs that no
# other job uses.

from persistentkv.names import EXPERIMENTS, FP8_EXPERIMENTS, FP8_KV, kv_grid_name

RESULTS = f"results/{HW}"
POLICY = f"{RESULTS}/policy.json"
GPU_JOB_THREADS = config["hardware"]["gpu_job_threads"]
#: Provenance sidecars the GPU commands write beside their parquet (docs/DATA.md).
SIDECARS = expand(f"{RESULTS}/raw/{{experiment}}.json", experiment=EXPERIMENTS) + [
    f"{RESULTS}/bench_kernels.json",
    f"{RESULTS}/validation_gpu.json",
]
#: What a GPU run adds to `all` (and what rendering results/<hw>/ should wait for).
MEASURE_TARGETS = expand(f"{RESULTS}/raw/{{experiment}}.parquet", experiment=EXPERIMENTS) + [
    f"{RESULTS}/bench_kernels.parquet",
    f"{RESULTS}/validation_gpu.parquet",
    POLICY,
    f"{RESULTS}/provenance.json",
    f"{RESULTS}/kernels.json",
]
#: The full decode step (rule measure_e2e) writes beside raw/, not in it: the results loader reads
#: raw/*.parquet as attention timing rows, and these rows have a schema of their own.
#: It runs as measure.e2e_passes independent passes (each its own job and process, one run_id), so
#: its verdicts can say how much a cell moves from one run to the next (targets.e2e_verdicts).
E2E_PASSES = range(1, int(config["measure"].get("e2e_passes", 1)) + 1)
E2E_TABLES = expand(f"{RESULTS}/e2e/pass{{n}}.parquet", n=E2E_PASSES)
SIDECARS += expand(f"{RESULTS}/e2e/pass{{n}}.json", n=E2E_PASSES)
MEASURE_TARGETS += E2E_TABLES


wildcard_constraints:
    experiment="|".join(EXPERIMENTS),


rule kernels_report:
    """The compile report of the kernels beside this GPU's results, copied whole (rule kernels)."""
    input:
        rules.kernels.output,
    output:
        report(f"{RESULTS}/kernels.json", caption="../report/kernels.rst", category="Kernels", subcategory=HW),
    log:
        f"logs/measure/{HW}/kernels_report.log",
    params:
        script=workflow.source_path("../scripts/copy_file.py"),
    conda:
        CONDA_ENV
    shell:
        job(
            "python {params.script} {input} {output} > {log} 2>&1",
        )


rule bench_kernels:
    input:
        kernels=rules.kernels.output,
    output:
        table=f"{RESULTS}/bench_kernels.parquet",
        provenance=f"{RESULTS}/bench_kernels.json",
    log:
        f"logs/measure/{HW}/bench_kernels.log",
    params:
        config=CONFIG_FILE,
        spec=config["spec"],
        measure=config["measure"],
    threads: GPU_JOB_THREADS
    resources:
        gpu=1,
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv bench-kernels --config {params.config} --out {output.table} > {log} 2>&1",
            gpu=HW,
        )


# The shapes experiment (config measure.bench_shapes): Hkv x G x B x bytes, every baseline, our
# routes and the one-kernel floor per case.
SIDECARS += [f"{RESULTS}/bench_shapes.json"]
MEASURE_TARGETS += [f"{RESULTS}/bench_shapes.parquet"]


rule bench_shapes:
    input:
        kernels=rules.kernels.output,
    output:
        table=f"{RESULTS}/bench_shapes.parquet",
        provenance=f"{RESULTS}/bench_shapes.json",
    log:
        f"logs/measure/{HW}/bench_shapes.log",
    params:
        config=CONFIG_FILE,
        spec=config["spec"],
        measure=config["measure"],
    threads: GPU_JOB_THREADS
    resources:
        gpu=1,
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv bench-shapes --config {params.config} --out {output.table} > {log} 2>&1",
            gpu=HW,
        )


# The two kernel grids again on each cache dtype of config measure.kv_dtypes (rules bench_kernels_fp8
# and bench_shapes_fp8 for float8_e4m3): the same cases, every row's kv_dtype naming the cache.
KV_GRID_COMMANDS = {"bench_kernels": "bench-kernels", "bench_shapes": "bench-shapes"}
for _kv_dtype in config["measure"].get("kv_dtypes", []):
    for _grid, _command in KV_GRID_COMMANDS.items():
        _stem = kv_grid_name(_grid, _kv_dtype)
        SIDECARS += [f"{RESULTS}/{_stem}.json"]
        MEASURE_TARGETS += [f"{RESULTS}/{_stem}.parquet"]

        rule:
            name:
                _stem
            input:
                kernels=rules.kernels.output,
            output:
                table=f"{RESULTS}/{_stem}.parquet",
                provenance=f"{RESULTS}/{_stem}.json",
            log:
                f"logs/measure/{HW}/{_stem}.log",
            params:
                config=CONFIG_FILE,
                spec=config["spec"],
                measure=config["measure"],
                # params, not the shell string: Snakemake evaluates a rule's shell when its job runs,
                # when the loop's variables hold their last values
                command=_command,
                kv_dtype=_kv_dtype,
            threads: GPU_JOB_THREADS
            resources:
                gpu=1,
            conda:
                CONDA_ENV
            shell:
                job(
                    "persistentkv {params.command} --config {params.config} --kv-dtype {params.kv_dtype}"
                    " --out {output.table} > {log} 2>&1",
                    gpu=HW,
                )


# The FP8 cache beyond the kernel grids (when config measure.kv_dtypes names float8_e4m3):
# validate-gpu and the full decode step over an FP8 cache (KV_RUNS: the rules at the end of this
# file, validate_gpu_fp8 and measure_e2e_fp8, into validation_gpu_fp8.parquet and e2e_fp8/), and
# what the FP8 cache does to the logits (fp8_logits). KV_RUNS maps a run's suffix to the option
# its commands get.
KV_RUNS = {"": ""}
if FP8_KV in config["measure"].get("kv_dtypes", []):
    KV_RUNS["_fp8"] = f" --kv-dtype {FP8_KV}"
    MEASURE_TARGETS += [f"{RESULTS}/validation_gpu_fp8.parquet", f"{RESULTS}/fp8_logits.parquet"]
    MEASURE_TARGETS += expand(f"{RESULTS}/e2e_fp8/pass{{n}}.parquet", n=E2E_PASSES)
    SIDECARS += [f"{RESULTS}/validation_gpu_fp8.json", f"{RESULTS}/fp8_logits.json"]
    SIDECARS += expand(f"{RESULTS}/e2e_fp8/pass{{n}}.json", n=E2E_PASSES)

    rule fp8_logits:
        """The logits of each model's decode loop over FP8 caches against its own dtype (fp8-logits)."""
        input:
            kernels=rules.kernels.output,
        output:
            table=f"{RESULTS}/fp8_logits.parquet",
            provenance=f"{RESULTS}/fp8_logits.json",
        log:
            f"logs/measure/{HW}/fp8_logits.log",
        params:
            config=CONFIG_FILE,
            spec=config["spec"],
            models=config.get("models", {}),
        threads: GPU_JOB_THREADS
        resources:
            gpu=1,
        conda:
            CONDA_ENV
        shell:
            job(
                "persistentkv fp8-logits --config {params.config} --device cuda --out {output.table} > {log} 2>&1",
                gpu=HW,
            )


# The experiments and the policy fitted on their calibration rows, once per entry of POLICY_RUNS
# (suffix -> experiments, folder, policy, the option their commands get): measure, measure_<experiment>
# and calibrate into raw/ and policy.json on the config's cache; with float8_e4m3 in measure.kv_dtypes
# also measure_fp8, measure_fp8_<experiment> and calibrate_fp8 for names.FP8_EXPERIMENTS into raw_fp8/
# (never pooled with raw/) and policy_fp8.json, judged on its holdout rows by claims.json's fp8.policy
# (targets_fp8.fp8_policy). `snakemake measure_published` or `measure_fp8_published` names one.
POLICY_RUNS = {"": (EXPERIMENTS, "raw", POLICY, "")}
if FP8_KV in config["measure"].get("kv_dtypes", []):
    POLICY_RUNS["_fp8"] = (FP8_EXPERIMENTS, "raw_fp8", f"{RESULTS}/policy_fp8.json", f" --kv-dtype {FP8_KV}")
    MEASURE_TARGETS += expand(f"{RESULTS}/raw_fp8/{{experiment}}.parquet", experiment=FP8_EXPERIMENTS)
    MEASURE_TARGETS += [POLICY_RUNS["_fp8"][2]]
    SIDECARS += expand(f"{RESULTS}/raw_fp8/{{experiment}}.json", experiment=FP8_EXPERIMENTS)

for _suffix, (_experiments, _raw, _policy, _kv_option) in POLICY_RUNS.items():

    rule:
        name:
            f"measure{_suffix}"
        input:
            traces=TRACE_FILES,
            kernels=rules.kernels.output,
            # the adaptive backend needs the calibrated policy in every experiment but calibration
            policy=lambda wildcards, policy=_policy: [] if wildcards.experiment == "calibration" else [policy],
        output:
            table=f"{RESULTS}/{_raw}/{{experiment}}.parquet",
            provenance=f"{RESULTS}/{_raw}/{{experiment}}.json",
        log:
            f"logs/measure/{HW}/{{experiment}}{_suffix}.log",
        wildcard_constraints:
            experiment="|".join(_experiments),
        params:
            config=CONFIG_FILE,
            spec=config["spec"],
            measure=config["measure"],
            traces_dir=lambda wildcards, input: os.path.dirname(input.traces[0]),
            policy=lambda wildcards, input: f"--policy {input.policy}" if input.policy else "",
            # params, not the shell string: the loop's variables hold their last values by then
            kv_option=_kv_option,
        threads: GPU_JOB_THREADS
        resources:
            gpu=1,
        conda:
            CONDA_ENV
        shell:
            job(
                "persistentkv measure --config {params.config} --experiment {wildcards.experiment}{params.kv_option}"
                " --traces-dir {params.traces_dir} --out {output.table} {params.policy} > {log} 2>&1",
                gpu=HW,
            )

    for _experiment in _experiments:

        rule:
            name:
                f"measure{_suffix}_{_experiment}"
            input:
                f"{RESULTS}/{_raw}/{_experiment}.parquet",

    rule:
        name:
            f"calibrate{_suffix}"
        input:
            timings=f"{RESULTS}/{_raw}/calibration.parquet",
        output:
            report(_policy, caption="../report/policy.rst", category="Policy", subcategory=HW),
        log:
            f"logs/measure/{HW}/calibrate{_suffix}.log",
        params:
            config=CONFIG_FILE,
            policy=config["policy"],
        conda:
            CONDA_ENV
        shell:
            job(
                "persistentkv calibrate --config {params.config} --timings {input.timings} --out {output} > {log} 2>&1",
            )


rule provenance:
    input:
        SIDECARS,
    output:
        report(f"{RESULTS}/provenance.json", caption="../report/provenance.rst", category="Provenance",
               subcategory=HW),
    log:
        f"logs/measure/{HW}/provenance.log",
    params:
        script=workflow.source_path("../scripts/merge_provenance.py"),
        # git commits of earlier runs made from a tree without .git (docs/DATA.md)
        annotations=(f"--annotations {RESULTS}/run_commits.json"
                     if os.path.isfile(f"{RESULTS}/run_commits.json") else ""),
    conda:
        CONDA_ENV
    shell:
        job(
            "python {params.script} --out {output} {params.annotations} {input} > {log} 2>&1",
        )


# validate-gpu (every backend against float64 at sampled trace steps) and the full decode step
# (measure-e2e in measure.e2e_passes passes: measure_e2e runs every measure_e2e_pass, each its own
# job and process), once per entry of KV_RUNS: validate_gpu, measure_e2e and measure_e2e_pass on the
# config's cache, and the same names with _fp8 on an FP8 cache (the backends without an FP8 path:
# rows that say why).
for _suffix, _kv_option in KV_RUNS.items():

    rule:
        name:
            f"validate_gpu{_suffix}"
        input:
            traces=TRACE_FILES,
            kernels=rules.kernels.output,
            policy=POLICY,
        output:
            table=in_report(f"{RESULTS}/validation_gpu{_suffix}.parquet", _suffix,
                            caption="../report/validation_gpu.rst", category="Validation", subcategory=HW),
            provenance=f"{RESULTS}/validation_gpu{_suffix}.json",
        log:
            f"logs/measure/{HW}/validate_gpu{_suffix}.log",
        params:
            config=CONFIG_FILE,
            spec=config["spec"],
            validation=config["validation"]["gpu"],
            traces_dir=lambda wildcards, input: os.path.dirname(input.traces[0]),
            # params, not the shell string: the loop's variables hold their last values by then
            kv_option=_kv_option,
        threads: GPU_JOB_THREADS
        resources:
            gpu=1,
        conda:
            CONDA_ENV
        shell:
            job(
                "persistentkv validate-gpu --config {params.config} --traces-dir {params.traces_dir}"
                "{params.kv_option} --out {output.table} --policy {input.policy} > {log} 2>&1",
                gpu=HW,
            )

    rule:
        name:
            f"measure_e2e{_suffix}"
        input:
            expand(f"{RESULTS}/e2e{_suffix}/pass{{n}}.parquet", n=E2E_PASSES),

    rule:
        name:
            f"measure_e2e{_suffix}_pass"
        input:
            kernels=rules.kernels.output,
        output:
            table=in_report(f"{RESULTS}/e2e{_suffix}/pass{{n}}.parquet", _suffix,
                            caption="../report/measure_e2e.rst", category="End to end", subcategory=HW),
            provenance=f"{RESULTS}/e2e{_suffix}/pass{{n}}.json",
        wildcard_constraints:
            n=r"[1-9][0-9]*",
        log:
            f"logs/measure/{HW}/e2e{_suffix}_pass{{n}}.log",
        params:
            config=CONFIG_FILE,
            spec=config["spec"],
            measure=config["measure"],
            models=config.get("models", {}),
            traces=config["traces"],
            kv_option=_kv_option,
        threads: GPU_JOB_THREADS
        resources:
            gpu=1,
        conda:
            CONDA_ENV
        shell:
            job(
                "persistentkv measure-e2e --config {params.config}{params.kv_option} --out {output.table}"
                " > {log} 2>&1",
                gpu=HW,
            )
