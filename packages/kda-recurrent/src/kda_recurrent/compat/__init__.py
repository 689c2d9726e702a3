"""Drop-in adapters for the calls serving stacks make today.

- :mod:`kda_recurrent.compat.fla`: ``fused_recurrent_kda_fwd``, FLA 0.6.0's in-place pool call (vLLM, SGLang).
"""
