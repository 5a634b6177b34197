# Compile kernels/ for the present GPU's architecture, else for hardware.kernel_archs (no GPU needed).

KERNEL_ARCHS = hardware.kernel_archs(config, hardware.detect_arch() if GPU else None)


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
        "persistentkv compile-kernels {params.archs} --out {output} > {log} 2>&1"
