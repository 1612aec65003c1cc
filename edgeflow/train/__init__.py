"""edgeflow.train: on-device training of ONNX models on the numpy kernels.

Reverse-mode autograd over the compiled graph (:mod:`.autograd`), PyTorch-
compatible optimizers (:mod:`.optim`), training-step memory planning
(:mod:`.memory`), quantization-aware fine-tuning (:mod:`.qat`) and export of
the trained weights back into the ONNX model (:mod:`.export`), driven by
:class:`Trainer`. Data loading lives apart, in :mod:`edgeflow.data`.
"""

from .autograd import Tape
from .losses import LOSSES, Loss, get_loss
from .memory import TrainingMemoryPlan, plan_training_step
from .optim import SGD, Adam, AdamW, Optimizer, clip_by_global_norm, global_norm, make_optimizer
from .trainer import EpochStats, History, StepResult, Trainer

__all__ = [
    "LOSSES", "SGD", "Adam", "AdamW", "EpochStats", "History", "Loss", "Optimizer", "StepResult", "Tape",
    "Trainer", "TrainingMemoryPlan", "clip_by_global_norm", "get_loss", "global_norm", "make_optimizer",
    "plan_training_step",
]
