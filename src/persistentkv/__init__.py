"""persistentkv: page-aware decode scheduling over a paged KV cache (planner, kernels, policy)."""

from .errors import PKVError
from .spec import AttentionSpec

__version__ = "0.1.0"
__all__ = ["AttentionSpec", "PKVError", "__version__"]
