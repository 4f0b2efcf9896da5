"""Calls and the compile-time flags their kernel configuration must carry (shared by the
config-selection tests of every CuTe kernel)."""

import torch

from cute_flash.backends.base import AttnArgs

FLAG_FIELDS = ("causal", "local", "softcap", "varlen_q", "varlen_k", "seqused_k")

FLAG_CASES = [
    (AttnArgs(0.1), {}),
    (AttnArgs(0.1, causal=True, window_right=0), {"causal": True}),
    (AttnArgs(0.1, causal=True, window_left=32, window_right=0), {"local": True}),
    (AttnArgs(0.1, window_left=-1, window_right=16), {"local": True}),
    (AttnArgs(0.1, softcap=30.0), {"softcap": True}),
    (AttnArgs(0.1, seqused_k=torch.ones(1, dtype=torch.int32)), {"seqused_k": True}),
]


def flags_of(config) -> dict:
    return {f: getattr(config, f) for f in FLAG_FIELDS}


def expected_flags(expected: dict) -> dict:
    return {f: expected.get(f, False) for f in FLAG_FIELDS}
