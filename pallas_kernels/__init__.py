"""Pallas kernels over kvjax's cache layout (installed as `kvjax.pallas_kernels`).

`decode_attention`: decode attention over the full-precision, INT8 and packed low-bit tiers
(Triton on GPU, Mosaic on TPU, the interpreters on CPU). `slot_write`: a decode step's slot
writes into several cache arrays in one launch (Triton; the interpreter on CPU).
"""
