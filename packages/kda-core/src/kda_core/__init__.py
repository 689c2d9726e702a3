"""kda-core: contracts, validation, environment knobs and PyTorch oracles of Kimi Delta Attention decode."""

from kda_core.errors import KDAError, fail

__version__ = "0.1.0"
__all__ = ["KDAError", "fail", "__version__"]
