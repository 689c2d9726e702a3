"""Stand-in for ``vllm.utils.flashinfer`` (the KDA names only): each is a lazy wrapper taking ``*args, **kwargs``
(FlashInfer itself is absent here: the wrapper reports that vLLM's binding ran)."""

ENGINE = "vllm-utils-flashinfer"


def _wrapper(name):
    def wrapper(*args, **kwargs):
        return ENGINE, name

    return wrapper


flashinfer_packed_fused_kda_decode = _wrapper("packed_fused_kda_decode")
flashinfer_fused_kda_decode = _wrapper("fused_kda_decode")  # not a target
