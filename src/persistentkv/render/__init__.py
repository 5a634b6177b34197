"""Rendering: figures (seaborn), LaTeX tables and macros (jinja2), the self-contained HTML report.

The output names live here, import-light, so the workflow rules can list every file a rule
writes without importing matplotlib at DAG-build time; the modules check their registries
against these tuples.
"""

#: Figures written by ``persistentkv figures`` as ``<name>.<svg|pdf>`` (render.figures.FIGURES).
FIGURE_NAMES = ("trace_ratios", "read_ceiling", "fanout_merge", "split_sensitivity", "batch_sweep", "policy",
                "engine", "validation", "shapes", "shapes_floor", "e2e", "fp8")
#: Formats a figure is written in (the suffix names it).
FIGURE_FORMATS = ("svg", "pdf", "png")
#: LaTeX tables written by ``persistentkv tables`` as ``tables/<name>.tex`` (beside macros.tex).
TABLE_NAMES = ("claims", "published_rows", "ablation", "provenance", "e2e", "fp8")
