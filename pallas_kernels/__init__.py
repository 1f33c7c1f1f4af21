"""Pallas decode-attention kernels over kvjax's cache layout (installed as `kvjax.pallas_kernels`).

Empty until the kernels issue lands; until then `kvjax.attention` uses its plain-jnp path.
"""
