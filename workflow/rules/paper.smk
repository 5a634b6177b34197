# The paper: paper/generated/ (PDF figures, LaTeX tables, macros.tex) from the
# reference hardware's results, and paper/main.pdf. Include after render.smk. PAPER_TARGETS
# (paper/generated/) belong in `all`; `paper_pdf` does not (it needs a TeX installation).

from types import SimpleNamespace

from persistentkv.render import FIGURE_NAMES, TABLE_NAMES

PAPER_HW = config["hardware"]["reference"]
PAPER_FIGURES = expand("paper/generated/figures/{name}.pdf", name=FIGURE_NAMES)
PAPER_TABLES = expand("paper/generated/tables/{name}.tex", name=TABLE_NAMES)
PAPER_TARGETS = ["paper/generated/macros.tex"] + PAPER_TABLES + PAPER_FIGURES


# The reference hardware's measured files (see render_measured).
paper_measured = lambda w: render_measured(SimpleNamespace(hw=PAPER_HW))


rule paper_figures:
    input:
        measured=paper_measured,
        counters=RENDER_COUNTERS,
        config=RENDER_CONFIG,
        code=RENDER_CODE,
    output:
        [
            report(f"paper/generated/figures/{name}.pdf", caption=f"../report/paper_figure.rst",
                   category="Paper", subcategory="Figures (PDF)")
            for name in FIGURE_NAMES
        ],
    conda:
        CONDA_ENV
    log:
        "logs/paper/figures.log",
    params:
        results=lambda w: f"results/{PAPER_HW}",
    shell:
        # as render_figures: the reference's folder may not exist yet
        job(
            "persistentkv figures --results {params.results} --counters results/counters --config {input.config}"
            " --format pdf --out-dir paper/generated/figures > {log} 2>&1",
            folder="{params.results}",
        )


rule paper_tables:
    input:
        measured=paper_measured,
        counters=RENDER_COUNTERS,
        config=RENDER_CONFIG,
        code=RENDER_CODE,
        claims=f"results/{PAPER_HW}/claims.json",
    output:
        macros=report("paper/generated/macros.tex", caption="../report/paper_macros.rst", category="Paper",
                      subcategory="Tables and macros"),
        tables=PAPER_TABLES,
    conda:
        CONDA_ENV
    log:
        "logs/paper/tables.log",
    params:
        results=lambda w: f"results/{PAPER_HW}",
    shell:
        job(
            "persistentkv tables --results {params.results} --counters results/counters --config {input.config}"
            " --claims {input.claims} --out-dir paper/generated > {log} 2>&1",
        )


rule paper_pdf:
    input:
        tex="paper/main.tex",
        bib="paper/refs.bib",
        generated=PAPER_TARGETS,
    output:
        "paper/main.pdf",
    conda:
        CONDA_ENV
    log:
        "logs/paper/pdf.log",
    params:
        build_dir=lambda w, output: os.path.join("build", "paper"),
    script:
        "../scripts/paper_pdf.py"
