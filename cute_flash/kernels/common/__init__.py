"""Helpers shared by the kernels of every arch: layouts, masks, online softmax, bookkeeping."""
