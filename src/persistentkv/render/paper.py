"""Build paper/main.pdf with latexmk (pdflatex + bibtex) or tectonic, whichever is installed.

The build runs in a separate folder (aux files stay out of paper/), fails on any undefined
reference or citation, and the PDF is copied onto its target atomically. It is byte-stable: the
engine runs with SOURCE_DATE_EPOCH fixed (:data:`SOURCE_DATE_EPOCH`), and main.tex omits pdfTeX's
dates and trailer id, so a rebuild of the same sources gives the same bytes.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

from ..errors import PKVError, require
from ..io import atomic_path

INSTALL_HINT = ("no TeX engine found: install one with 'apt-get install latexmk lmodern texlive-latex-recommended "
                "texlive-latex-extra texlive-fonts-recommended' (Debian/Ubuntu) or put 'tectonic' on PATH")
#: The time TeX engines write wherever they would write the build's clock (pdfTeX with
#: FORCE_SOURCE_DATE, tectonic): fixed, so no timestamp depends on when the paper was built.
SOURCE_DATE_EPOCH = "0"
#: A TeX error: "! LaTeX Error: ..." or, under -file-line-error, "./main.tex:8: ...".
_ERROR = re.compile(r"^(!.*|\S+\.(tex|sty|cls|bbl):\d+: .*)$", re.M)
_WHERE = re.compile(r"^l\.\d+ .*$", re.M)
_UNDEFINED = re.compile(r"(Reference|Citation) [`'\"]?([^'`\"]+)['`\"]? (on page \d+ )?undefined"
                        r"|There were undefined references|Undefined control sequence")


def engine() -> list[str]:
    """The build command prefix for the first engine found, else PKVError with the install hint."""
    if shutil.which("latexmk") and shutil.which("pdflatex"):
        return ["latexmk", "-pdf", "-interaction=nonstopmode", "-halt-on-error", "-file-line-error"]
    if shutil.which("tectonic"):
        return ["tectonic", "--keep-logs"]
    raise PKVError(INSTALL_HINT)


def build_pdf(tex: str | Path, out_pdf: str | Path, build_dir: str | Path, log=None) -> Path:
    """Compile ``tex`` (run from its own folder, so \\input paths are relative to it) into ``out_pdf``."""
    tex, out_pdf = Path(tex).resolve(), Path(out_pdf)
    require(tex.is_file(), f"{tex} does not exist")
    build_dir = Path(build_dir).resolve()
    build_dir.mkdir(parents=True, exist_ok=True)
    cmd = engine()
    cmd += [f"-outdir={build_dir}", tex.name] if cmd[0] == "latexmk" else ["--outdir", str(build_dir), tex.name]
    env = {**os.environ, "SOURCE_DATE_EPOCH": SOURCE_DATE_EPOCH, "FORCE_SOURCE_DATE": "1"}
    proc = subprocess.run(cmd, cwd=tex.parent, capture_output=True, text=True, errors="replace", env=env)
    if log is not None:
        log.write(proc.stdout + proc.stderr)
    tex_log = build_dir / f"{tex.stem}.log"
    text = tex_log.read_text(errors="replace") if tex_log.is_file() else proc.stdout
    if proc.returncode != 0:
        error = _ERROR.search(text)
        first = error.group(0).strip() if error else f"{cmd[0]} exited with status {proc.returncode}"
        where = _WHERE.search(text, error.end()) if error else None   # TeX's "l.150 ... \pkvMargin"
        if where and text.count("\n", error.end(), where.start()) <= 4:
            first = first.rstrip(".") + f" at {' '.join(where.group(0).split())}"
        raise PKVError(f"{tex.name} did not build: {first} (full log: {tex_log})")
    bad = _UNDEFINED.search(text)
    if bad:
        raise PKVError(f"{tex.name} built with an undefined reference: {bad.group(0)} (see {tex_log})")
    pdf = build_dir / f"{tex.stem}.pdf"
    require(pdf.is_file(), f"{cmd[0]} reported success but wrote no {pdf}")
    with atomic_path(out_pdf) as tmp:
        shutil.copyfile(pdf, tmp)
    return out_pdf
