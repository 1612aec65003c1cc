"""edgeflow's graph optimizer: one pass pipeline used by the numpy backend,
quantization and training.

    from edgeflow.runtime.optimize import optimize_model
    fast = optimize_model(model, shapes={"x": (1, 3, 320, 320)})
    trainable = optimize_model(model, for_training=True)

See :mod:`edgeflow.runtime.optimize.pipeline` and ``docs/optimizer.md``.
"""

from .ir import Graph, Node, PassOptions, from_model, to_model
from .pipeline import (
    MODEL_PASSES,
    NUMPY_PASSES,
    OptimizeReport,
    Optimized,
    op_counts,
    optimize,
    optimize_compiled,
    optimize_model,
)

__all__ = [
    "Graph",
    "MODEL_PASSES",
    "NUMPY_PASSES",
    "Node",
    "OptimizeReport",
    "Optimized",
    "PassOptions",
    "from_model",
    "op_counts",
    "optimize",
    "optimize_compiled",
    "optimize_model",
    "to_model",
]
