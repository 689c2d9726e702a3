"""Drop-in replacements for the KDA decode functions vLLM vendors.

- :mod:`kda_recurrent.compat.vllm.kimi_k3`: Kimi K3's ``fused_recurrent_kda_packed_decode`` (plain T=1 decode from
  the packed post-conv rows) and ``fused_recurrent_kda`` (speculative decode from raw gate and beta).
- :mod:`kda_recurrent.compat.vllm.kimi_linear`: the shared KDA layer's ``fused_recurrent_kda`` (Kimi-Linear; a
  precomputed gate and beta).

Every function here treats slot indices ``<= 0`` as null (vLLM's ``NULL_BLOCK_ID = 0``):
``NullSlotPolicy.NONPOSITIVE``, docs/design.md §4. :mod:`kda_recurrent.integrations.vllm` installs them in vLLM.
"""
