"""kda-recurrent: the ``recurrent_kda`` facade, the ucache API and serving adapters of Kimi Delta Attention decode.

``recurrent_kda`` routes each call to the fastest kda-cute kernel that accepts it, or to the kda-core oracle when
kda-cute is not installed (slow, with a one-time warning); ``explain`` says which path a call would take.
``kda_delta_rule_mtp_ucache_flush`` and its companions are the speculative-decode replay-cache API (docs/design.md §5).
``recoverssm_commit`` and ``RecoverSSMCommit`` fold a RecoverSSM verify's accepted prefix into the checkpoints
(docs/design.md §9). ``fused_kda_decode`` is one T=1 step of a whole KDA layer (conv, the recurrence, gated
RMSNorm; docs/design.md §8).
``python -m kda_recurrent.demo`` is the README's main job.
"""

from kda_recurrent import ops as _ops  # noqa: F401 (registers the kda::recurrent_kda op the facade traces)
from kda_recurrent.facade import explain, recurrent_kda
from kda_recurrent.fused import fused_kda_decode, packed_fused_kda_decode
from kda_recurrent.spec import RecoverSSMCommit, recoverssm_commit
from kda_recurrent.ucache import allocate_cursors, allocate_ucache, commit_ucache, kda_delta_rule_mtp_ucache_flush

__version__ = "0.1.0"
__all__ = [
    "__version__",
    "allocate_cursors",
    "allocate_ucache",
    "commit_ucache",
    "explain",
    "fused_kda_decode",
    "kda_delta_rule_mtp_ucache_flush",
    "packed_fused_kda_decode",
    "recoverssm_commit",
    "RecoverSSMCommit",
    "recurrent_kda",
]
