"""Zoo models with heads of 16 dims, for FlexAttention's Triton kernels (``tl.dot`` takes no
fewer): the zoo's configs have heads of 8 (``tests/test_gpu.py::test_one_gpu_flex_attention``)."""

from __future__ import annotations

from autopart.models import zoo


def gemma2_wide():
    return zoo.make("gemma2", head_dim=16)


def gpt_oss_wide():
    return zoo.make("gpt_oss", head_dim=16)
