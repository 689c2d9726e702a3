"""Stand-in for ``sglang.srt.layers.attention.linear.kernels.kda_triton``: binds the packed decode's name at import,
and defines the Triton KDA kernel class with ``target_verify``'s signature (its body only reports that SGLang's own
method ran, with what it was given), and a wrapper kernel that forwards to one, as SGLang's other KDA kernels do."""

from typing import Optional

from sglang.kernels.ops.attention.fla.fused_recurrent import fused_recurrent_kda_packed_decode  # noqa: F401


class LinearAttnKernelBase:
    pass


class TritonKDAKernel(LinearAttnKernelBase):
    def target_verify(
        self,
        A_log,
        dt_bias,
        q,
        k,
        v,
        a,
        b,
        *,
        ssm_states,
        cache_indices,
        query_start_loc,
        intermediate_states_buffer,
        intermediate_state_indices,
        cache_steps: int,
        retrieve_parent_token: Optional[object],
        lower_bound: Optional[float] = None,
        cache_ring: bool = False,
        replayssm_rawv=None,
        replayssm_rawk=None,
        replayssm_g=None,
        replayssm_beta=None,
        **kwargs,
    ):
        return "sglang", "target_verify", dict(cache_ring=cache_ring, replayssm_rawv=replayssm_rawv,
                                               cache_steps=cache_steps, lower_bound=lower_bound, **kwargs)


class WrappedKDAKernel(LinearAttnKernelBase):
    """A KDA kernel whose verify is the Triton kernel's (SGLang's ``self._triton.target_verify(*args, **kwargs)``)."""

    def __init__(self):
        self._triton = TritonKDAKernel()

    def target_verify(self, *args, **kwargs):
        return self._triton.target_verify(*args, **kwargs)
