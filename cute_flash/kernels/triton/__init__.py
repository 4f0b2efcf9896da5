"""Triton kernels of the HIP fallback: the same attention as the CuTe kernels, for ROCm (and,
selected by name, for NVIDIA GPUs, which is where they are tested on hardware).

* `common`: device helpers shared by every kernel: where a sequence lives, which key (query)
  blocks a query (key) block can see, the mask, the scores in log2 space, the MMA helper.
* `fwd`: the forward kernel (online softmax over key blocks).
* `bwd`: the backward kernels (D = rowsum(dO * O) - dlse; dK/dV per key block; dQ per query
  block), deterministic by construction: no atomics.

Importing this package does not import Triton; its modules do, and `@triton.jit` decides at
import time whether a kernel is compiled or interpreted (`TRITON_INTERPRET=1`).

Naming follows the CuTe kernels where it applies: ``acc_<X>`` fp32 accumulators; ``offs_m`` /
``offs_n`` / ``offs_d`` row (query), column (key) and head-dim indices of a tile; upper-case
names are pointers (``Q``, ``K``) or compile-time constants (``BLOCK_M``); ``stride_<t><dim>``
the stride of tensor t along b (batch), m (query row), n (key row) or h (head). Every stride is
the tensor's own; the head dim has unit stride (checked by `cute_flash.api`).
"""
