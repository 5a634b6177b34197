"""Rule paper_pdf: paper/main.pdf via persistentkv.render.paper (latexmk or tectonic).

Without a TeX engine it fails with one line saying how to install one.
"""

import sys

from persistentkv.errors import PKVError
from persistentkv.render.paper import build_pdf

with open(snakemake.log[0], "w") as log:  # noqa: F821 (snakemake injects it)
    try:
        build_pdf(snakemake.input.tex, snakemake.output[0], snakemake.params.build_dir, log)  # noqa: F821
    except PKVError as exc:
        print(f"error: {exc}", file=log)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
