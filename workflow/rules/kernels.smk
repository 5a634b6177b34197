# Compile kernels/ for the GPU hardware.target: auto found, else for hardware.kernel_archs (no GPU needed).

KERNEL_ARCHS = hardware.kernel_archs(config, HW)


rule kernels:
    input:
        sorted(glob.glob("kernels/*.cu") + glob.glob("kernels/*.cuh")),
    output:
        "build/kernels/report.json",
    log:
        "logs/kernels/compile.log",
    params:
        archs=" ".join(f"--arch {arch}" for arch in KERNEL_ARCHS),
    conda:
        CONDA_ENV
    shell:
        job(
            "persistentkv compile-kernels {params.archs} --out {output} > {log} 2>&1",
        )
