"""The 1-D bulk-copy ring shared by the T=1 kernel's large-batch rows (``kda_cute.decode_t1``, and the fused layer
built on it) and the RecoverSSM commit's ring (``kda_cute.recoverssm``).

A state of ``n_chunks`` contiguous chunks streams global -> shared -> global through ``ring`` slots. Chunk c lives
in slot c % ring and is the (c // ring)-th fill of that slot's mbarrier, so every wait parity is static. One thread
(thread 0) issues every bulk copy; the CTA's threads update each chunk in place in its slot.

Traced inline (``@cute.jit`` functions of compile-time lists): ``full`` the slots' mbarrier pointers, ``s_slots``
the slots and ``g_chunks`` the state's chunks as 1-D tensors of ``chunk_bytes``, ``bulk_load`` / ``bulk_store``
the cp.async.bulk copy atoms. ``first``: None, or chunk 0's own (slot view, global view, load atom, store atom, bytes),
for a ring whose first chunk is shorter (the pool-realigning T=1 variant's: its first 16 bytes are a thread's).
"""

import cutlass
import cutlass.cute as cute
from cutlass import const_expr


@cute.jit
def fill(ring: cutlass.Constexpr, n_chunks: cutlass.Constexpr, full, s_slots, g_chunks, bulk_load,
         chunk_bytes: cutlass.Constexpr, first=None):
    """By one thread: the slots' mbarriers (arrival count 1: its own arrive.expect_tx), then the first
    min(ring, n_chunks) chunks. The CTA barrier that makes the inits visible before anyone waits is the caller's."""
    for r in cutlass.range_constexpr(ring):
        cute.arch.mbarrier_init(full[r], 1)
    cute.arch.mbarrier_init_fence()
    for c in cutlass.range_constexpr(min(ring, n_chunks)):
        if const_expr(c == 0 and first is not None):
            s0, g0, load0, _, bytes0 = first
            cute.arch.mbarrier_arrive_and_expect_tx(full[c], bytes0)
            cute.copy(load0, g0, s0, mbar_ptr=full[c])
        else:
            cute.arch.mbarrier_arrive_and_expect_tx(full[c], chunk_bytes)
            cute.copy(bulk_load, g_chunks[c], s_slots[c], mbar_ptr=full[c])


@cute.jit
def store_and_refill(j: cutlass.Constexpr, ring: cutlass.Constexpr, n_chunks: cutlass.Constexpr, full, s_slots,
                     g_chunks, bulk_load, bulk_store, chunk_bytes: cutlass.Constexpr, tidx, first=None, g_out=None):
    """Chunk ``j`` after every thread wrote its part of it back into its slot: bulk-store the slot (to
    ``g_chunks[j]``, or ``g_out[j]`` when given: a state read from one place and written to another), and refill the
    previous chunk's slot with the chunk ``ring`` past it.

    The refill waits (``wait_group.read 1``) only for the previous chunk's store to have read its slot, which had a
    whole chunk's compute to do so: the current store is not waited for."""
    slot = j % ring
    # Generic-proxy writes -> async-proxy reads (the bulk store): fence by every writer, then the CTA barrier.
    cute.arch.fence_proxy("async.shared", space="cta")
    cute.arch.sync_threads()
    if tidx == 0:
        if const_expr(j == 0 and first is not None):
            cute.copy(first[3], first[0], first[1])
        else:
            if const_expr(g_out is None):
                cute.copy(bulk_store, s_slots[slot], g_chunks[j])
            else:
                cute.copy(bulk_store, s_slots[slot], g_out[j])
        cute.arch.cp_async_bulk_commit_group()
        if const_expr(j >= 1 and j - 1 + ring < n_chunks):
            prev = (j - 1) % ring
            cute.arch.cp_async_bulk_wait_group(1, read=True)
            cute.arch.mbarrier_arrive_and_expect_tx(full[prev], chunk_bytes)
            cute.copy(bulk_load, g_chunks[j - 1 + ring], s_slots[prev], mbar_ptr=full[prev])


@cute.jit
def drain(tidx):
    """Every bulk store complete before the CTA exits (by the issuing thread)."""
    if tidx == 0:
        cute.arch.cp_async_bulk_wait_group(0)
