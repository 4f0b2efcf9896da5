"""CuTe DSL device code: one kernel class per arch and direction, shared helpers in `common`.
A kernel class too long to read in one sitting takes its parts from mixins in sibling modules,
one part each (the sm_90 backward: `bwd_dq`, `bwd_masks`, `bwd_epilogue`, `bwd_keys_n`; the
sm_90 forward: `fwd_persistent`, `fwd_halves`), and the named barriers and the order of the work
that its roles share are in `bwd_sync` / `fwd_sync`.

Naming (CuTe's convention, used everywhere in this package):

* ``m<X>``: the whole tensor X in global memory (``mQ``, ``mK``, ``mLSE``).
* ``g<X>``: one tile of X in global memory (``gQ`` is the Q tile of this CTA).
* ``s<X>``: a tile of X in shared memory (``sK`` may carry a stage mode for a multi-buffered ring).
* ``r<X>``: a fragment of X in registers (``rP`` is the probability tile converted to fp16/bf16).
* ``c<X>``: an identity ("coordinate") tensor with the shape of X; partitioned like X it tells
  each thread the logical (row, column) of every element it holds, which is how tails are
  predicated and masks are applied.
* ``t<part><X>``: X partitioned for one thread by the object named by ``<part>``:
  ``tSrQ`` is Q in registers as the A operand of the S = Q K^T MMA, ``tOsVt`` is V^T in shared
  memory as seen by the ldmatrix copy feeding the O = P V MMA, ``tKgK`` is K in global memory
  as seen by the cp.async copy, ``tOpO`` the predicates of the O store.
* ``acc_<X>``: fp32 MMA accumulators (``acc_S`` scores, ``acc_O`` output).
* ``*_mn`` views re-index an accumulator as (rows, columns) of the tile, so that row-wise
  softmax and masking are plain loops.
"""
