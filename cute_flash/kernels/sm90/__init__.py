"""sm_90a kernels: TMA + WGMMA, warp-specialized (see `fwd.py`)."""
