"""The build's one hook: the wheel (and so ``pip install .``) carries the repository's top-level
kernels/, the CUDA sources that CuPy and nvcc compile at run time, as ``persistentkv/kernels/``.
kernels/ stays the one copy in git; an editable install reads it in place. Everything else is in
pyproject.toml; MANIFEST.in puts kernels/ in the sdist, so a wheel built from the sdist has it too.
persistentkv.launch.kernels_dir finds either."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

KERNELS = Path(__file__).resolve().parent / "kernels"
PATTERNS = ("*.cu", "*.cuh")


class BuildPyWithKernels(build_py):
    """build_py, then kernels/*.cu and *.cuh into the built package's kernels/ (not for an
    editable install, which uses the checkout's kernels/)."""

    def run(self):
        super().run()
        if self.editable_mode:
            return
        sources = sorted(p for pattern in PATTERNS for p in KERNELS.glob(pattern))
        if not sources:
            raise SystemExit(f"setup.py: no kernel sources ({', '.join(PATTERNS)}) in {KERNELS}")
        target = Path(self.build_lib) / "persistentkv" / "kernels"
        shutil.rmtree(target, ignore_errors=True)   # a kernel removed from kernels/ leaves the build too
        self.mkpath(str(target))
        for source in sources:
            self.copy_file(str(source), str(target / source.name))


setup(cmdclass={"build_py": BuildPyWithKernels})
