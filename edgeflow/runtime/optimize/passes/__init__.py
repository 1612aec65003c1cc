"""The optimizer's passes, one per module.

Portable passes (``Graph -> Graph`` on :mod:`edgeflow.runtime.optimize.ir`; the
result is a valid ONNX model any backend runs): :mod:`.constants`,
:mod:`.identity`, :mod:`.fold`, :mod:`.fuse_bn`, :mod:`.fuse_hardswish`, :mod:`.dce`, :mod:`.subgraphs`
(all of them inside If/Loop/Scan bodies).

numpy-backend passes (``CompiledGraph -> CompiledGraph``, on the node list
bound to kernels; the result runs only on the numpy executor):
:mod:`.fuse_qdq`, :mod:`.prepack_gemm`, :mod:`.prepack_lstm`, :mod:`.fuse_se`,
:mod:`.fuse_layernorm`, :mod:`.fuse_activation`.
"""

from .constants import constants_to_initializers
from .dce import remove_dead_nodes
from .fold import fold_constants
from .fuse_activation import fuse_activation
from .fuse_bn import fuse_batchnorm, fuse_conv_affine
from .fuse_hardswish import fuse_hardswish
from .fuse_layernorm import fuse_layernorm
from .fuse_qdq import fuse_qdq
from .fuse_se import fuse_se
from .identity import remove_identity
from .prepack_gemm import prepack_gemm
from .prepack_lstm import prepack_lstm
from .subgraphs import inline_constant_if, optimize_subgraphs

__all__ = [
    "constants_to_initializers",
    "fold_constants",
    "fuse_activation",
    "fuse_batchnorm",
    "fuse_conv_affine",
    "fuse_hardswish",
    "fuse_layernorm",
    "fuse_qdq",
    "fuse_se",
    "inline_constant_if",
    "optimize_subgraphs",
    "prepack_gemm",
    "prepack_lstm",
    "remove_dead_nodes",
    "remove_identity",
]
