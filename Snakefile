# persistentkv: seeded traces -> counters, CPU validation, ablations, kernels -> (GPU) measurements
# -> the HTML report and the paper. `snakemake --cores 1 all` works without a GPU; see docs/WORKFLOW.md.
import sys

from snakemake.utils import min_version

from persistentkv import configuration, hardware
from persistentkv.errors import PKVError

min_version("9.0")


configfile: "config/config.yaml"


#: The grid every command reads: --configfile FILE if given, else config/config.yaml.
CONFIG_FILE = str(workflow.configfiles[0])

# One line, no traceback, for a bad config or `hardware.measure: always` without a GPU.
try:
    configuration.validate_config(config)
    configuration.check_config_file(config, CONFIG_FILE)
    GPU = hardware.detect_gpu()
    MEASURE = hardware.measure_enabled(config, gpu=GPU)
except PKVError as exc:
    sys.exit(f"error: {exc}")


include: "workflow/rules/common.smk"
include: "workflow/rules/traces.smk"
include: "workflow/rules/counters.smk"
include: "workflow/rules/validate.smk"
include: "workflow/rules/kernels.smk"


if MEASURE:

    include: "workflow/rules/measure.smk"


include: "workflow/rules/render.smk"
include: "workflow/rules/paper.smk"


rule all:
    default_target: True
    input:
        rules.traces.input,
        rules.counters.input,
        rules.validate_cpu.output,
        rules.ablation_buckets.output,
        rules.ablation_splits.output,
        rules.kernels.output,
        MEASURE_TARGETS if MEASURE else [],
        RENDER_TARGETS,
        PAPER_TARGETS,
