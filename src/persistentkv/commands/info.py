"""``persistentkv info``: versions, the GPU (or none), and which backends can run here, with reasons."""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
from importlib import metadata

from .. import __version__, configuration, hardware
from ..spec import AttentionSpec

#: distribution names whose versions matter to a run (pip names, so nothing is imported).
PACKAGES = ("numpy", "pandas", "pyarrow", "matplotlib", "seaborn", "jsonschema", "snakemake", "torch",
            "cupy-cuda13x", "cupy-cuda12x", "flashinfer-python", "vllm", "tensorrt-llm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", default=None, metavar="YAML",
                        help="take the attention spec from this config (default: config/config.yaml if "
                             "present, else the published shape)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def _version(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def backend_reasons(spec: AttentionSpec) -> dict[str, list[str]] | str:
    """{backend: reasons it cannot run ``spec`` here} from the registry, or why there is none."""
    try:
        registry = importlib.import_module("persistentkv.backends.registry")
    except ImportError as exc:
        return f"the backend registry cannot be imported ({exc})"
    result: dict[str, list[str]] = {}
    for name in registry.names():
        try:
            result[name] = list(registry.create(name).unavailable(spec))
        except Exception as exc:  # an adapter that cannot even be created is a reason, not a crash
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            result[name] = [text]
    return result


def collect(config_path: str | None) -> dict:
    if config_path is not None or configuration.DEFAULT_CONFIG.is_file():
        config = configuration.load_config(config_path or configuration.DEFAULT_CONFIG)
        spec, spec_from = configuration.spec(config), str(config_path or configuration.DEFAULT_CONFIG)
    else:
        spec, spec_from = AttentionSpec(), "the published shape (no config found)"
    gpu = hardware.detect_gpu()
    return {
        "persistentkv": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "packages": {name: _version(name) for name in PACKAGES},
        "gpu": gpu,
        "gpu_arch": hardware.detect_arch() if gpu else None,
        "hw": hardware.slug(gpu) if gpu else None,
        "spec": spec.to_dict(),
        "spec_from": spec_from,
        "backends": backend_reasons(spec),
    }


def run(args: argparse.Namespace) -> int:
    info = collect(args.config)
    if args.json:
        print(json.dumps(info, indent=2, sort_keys=True))
        return 0
    print(f"persistentkv {info['persistentkv']}  (Python {info['python']}, {info['platform']})")
    installed = [f"{k} {v}" for k, v in info["packages"].items() if v]
    missing = [k for k, v in info["packages"].items() if not v]
    print("packages: " + ", ".join(installed))
    if missing:
        print("not installed: " + ", ".join(missing))
    if info["gpu"]:
        print(f"GPU: {info['gpu']} ({info['gpu_arch'] or 'arch unknown'}), results folder results/{info['hw']}/")
    else:
        print("GPU: none found (nvidia-smi missing or lists none): the workflow renders the committed reference")
    spec = info["spec"]
    print(f"spec ({info['spec_from']}): Hq={spec['num_qo_heads']} Hkv={spec['num_kv_heads']} "
          f"D={spec['head_dim']} page={spec['page_size']} {spec['dtype']}")
    backends = info["backends"]
    if isinstance(backends, str):
        print(f"backends: {backends}")
        return 0
    width = max(len(name) for name in backends)
    print("backends:")
    for name, reasons in backends.items():
        print(f"  {name:<{width}}  " + ("usable" if not reasons else "unavailable: " + "; ".join(reasons)))
    return 0
