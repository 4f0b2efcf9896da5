"""sm_80 kernels (cp.async + ldmatrix + mma.sync); they also run on sm_90 when compiled for it."""
