"""kda-recurrent: the ``recurrent_kda`` facade, the ucache API and serving adapters of Kimi Delta Attention decode.

In progress: the facade and the ucache API have not landed yet, so this package exports nothing that would pretend
to compute. What works today is the README's main job, ``python -m kda_recurrent.demo``: a Kimi K3-shaped decode
loop on the kda-core PyTorch oracle, on the CPU.
"""

__version__ = "0.1.0"
__all__ = ["__version__"]
