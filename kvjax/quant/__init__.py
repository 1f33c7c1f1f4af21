"""Pure-array KV quantization: INT8 symmetric, INT2/INT4 asymmetric (KIVI style), bit packing.

The bottom of the import graph: nothing here imports the rest of kvjax. Every function is
jit-compatible (bits, group and dtype are static), works for any leading axes and computes in
float32.
"""

from kvjax.quant._checks import BITS
from kvjax.quant._int8 import (
    INT8_MAX,
    dequantize_int8,
    dequantize_int8_channel,
    int8_bytes_per_token,
    quantize_int8,
    quantize_int8_channel,
)
from kvjax.quant._kernel_layout import (
    check_kernel_layout,
    dequantize_kernel_pages,
    pack_nibbles,
    quantize_kernel_pages,
    quantize_offset,
)
from kvjax.quant._lowbit import (
    STAT_DTYPE,
    bytes_per_token,
    dequantize_per_channel,
    dequantize_per_token,
    quantize_keys_values,
    quantize_per_channel,
    quantize_per_token,
)
from kvjax.quant._pack import codes_per_byte, pack, unpack
from kvjax.quant._words_layout import (
    check_words_layout,
    dequantize_words_pages,
    quantize_words_pages,
)

__all__ = [
    "BITS",
    "INT8_MAX",
    "STAT_DTYPE",
    "bytes_per_token",
    "check_kernel_layout",
    "check_words_layout",
    "codes_per_byte",
    "dequantize_int8",
    "dequantize_int8_channel",
    "dequantize_kernel_pages",
    "dequantize_per_channel",
    "dequantize_per_token",
    "dequantize_words_pages",
    "int8_bytes_per_token",
    "pack",
    "pack_nibbles",
    "quantize_int8",
    "quantize_int8_channel",
    "quantize_kernel_pages",
    "quantize_keys_values",
    "quantize_offset",
    "quantize_per_channel",
    "quantize_per_token",
    "quantize_words_pages",
    "unpack",
]
