"""A Llama-architecture decode loop in plain torch around the attention backends.

    shape.py   ModelShape (config ``models:``), the bytes a configuration needs, the one-line refusal
    llama.py   seeded weights, RMSNorm, rotary embedding (Hugging Face's rotate-half), SwiGLU,
               device-side sampling (greedy, seeded top-k), torch or FlashInfer kernels
    pages.py   the paged cache of every layer (PagedKV) and its page pool (PagePool)
    loop.py    Model (the layers' forward), DecodeLoop (append, attention through the backend,
               eager step, CUDA-graph capture and replay, trace-driven arrivals and departures)

Checked against transformers' LlamaForCausalLM on the CPU (tests/test_model.py) and against a
float32 reference loop on the GPU (tests/test_gpu_model.py); measured by ``persistentkv
measure-e2e``, whose graphs beyond the step live on the measurement side
(persistentkv.measure.steps). Imports torch only inside functions, like the backends.
"""

from .llama import KERNEL_CHOICES, Kernels, Sampling, Weights, random_weights, sample
from .loop import FOLLOW_MODES, DecodeLoop, Model, follow_mode
from .pages import PagedKV, PagePool
from .shape import Footprint, ModelShape, check_fits, footprint, model_cases, model_shape, model_traces

__all__ = ["KERNEL_CHOICES", "Kernels", "Sampling", "Weights", "random_weights", "sample", "FOLLOW_MODES",
           "DecodeLoop", "Model", "PagedKV", "PagePool", "follow_mode", "Footprint", "ModelShape", "check_fits",
           "footprint", "model_cases", "model_shape", "model_traces"]
