"""The on-device trainer: an ONNX model, a loss, an optimizer, and data.

    trainer = Trainer(model, loss="cross_entropy", optimizer="sgd", lr=0.05, momentum=0.9,
                      freeze=["conv"], batch_size=32, seed=0)
    history = trainer.fit((x, y), epochs=5)
    trainer.export("trained.onnx")

Everything runs on the numpy kernels (``edgeflow.train.autograd``). What a
federated client needs is here too: ``get_weights`` / ``set_weights``,
``delta_from``, ``proximal_mu`` (FedProx), ``evaluate``, a deterministic
``seed``, and the number of samples and mean loss in the returned History.

Failure is loud and early: an op without a backward on the gradient path,
labels out of range, inputs of the wrong shape and a step over the memory
budget are errors at construction or before the first step; a NaN/inf
loss or gradient stops training with :class:`TrainingError` and the step
that produced it is not applied, so the weights stay the last good ones.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx

from ..data import Dataset, as_loader, check_inputs, check_labels, from_arrays
from ..errors import InputError, MemoryBudgetError, ShapeError, TrainingError
from ..profiles import DeviceProfile, get_profile
from ..runtime.graph import compile_graph
from ..runtime.model import ModelSource, load_model
from .autograd import NON_DIFFERENTIABLE_INPUTS, Tape, refuse_control_flow
from .export import save as save_model
from .export import with_weights
from .feeds import batch_len, check_known, convert, labels, missing_message, read_split
from .losses import Loss, get_loss
from .memory import BudgetDecision, TrainingMemoryPlan, fit_budget, plan_training_step
from .optim import Optimizer, clip_by_global_norm, global_norm, make_optimizer
from .transfer import (
    Mode,
    describe,
    find_layers,
    fuse_hardswish,
    largest_fitting,
    logits_of,
    parse_mode,
    prepare_model,
    select,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepResult:
    """One optimizer step: mean loss over the batch, correct predictions, samples, gradient norm."""

    loss: float
    correct: int | None
    samples: int
    grad_norm: float


@dataclass(frozen=True)
class EpochStats:
    epoch: int
    loss: float
    accuracy: float | None
    samples: int
    steps: int
    seconds: float
    val_loss: float | None = None
    val_accuracy: float | None = None


@dataclass
class History:
    """What one ``fit`` did, epoch by epoch."""

    epochs: list[EpochStats] = field(default_factory=list)

    @property
    def loss(self) -> list[float]:
        return [e.loss for e in self.epochs]

    @property
    def accuracy(self) -> list[float | None]:
        return [e.accuracy for e in self.epochs]

    @property
    def num_samples(self) -> int:
        """Samples in one epoch (the weight of this client's update in FedAvg)."""
        return self.epochs[-1].samples if self.epochs else 0

    @property
    def samples_seen(self) -> int:
        return sum(e.samples for e in self.epochs)

    @property
    def mean_loss(self) -> float:
        """Sample-weighted mean training loss over every step of the fit."""
        n = self.samples_seen
        return sum(e.loss * e.samples for e in self.epochs) / n if n else float("nan")

    def to_dict(self) -> dict:
        return {"epochs": [asdict(e) for e in self.epochs], "num_samples": self.num_samples,
                "mean_loss": self.mean_loss}


def _fixed_batch(inputs: Sequence[Any]) -> int | None:
    """The leading dim the graph fixes on its per-sample inputs (they must agree), or None."""
    dims = {t.shape[0] for t in inputs if t.shape}
    fixed = {d for d in dims if isinstance(d, int) and d > 0}
    return fixed.pop() if len(fixed) == 1 and len(dims) == 1 else None


def _matches(name: str, patterns: Sequence[str]) -> bool:
    return any(name == p or name.startswith(p) for p in patterns)


def _check_settings(batch_size: int, epochs: int, clip_norm: float | None, proximal_mu: float) -> None:
    if int(batch_size) < 1 or int(epochs) < 0:
        raise InputError(f"batch_size must be >= 1 and epochs >= 0; got {batch_size} and {epochs}")
    if clip_norm is not None and clip_norm <= 0:
        raise InputError(f"clip_norm must be > 0, got {clip_norm}")
    if proximal_mu < 0:
        raise InputError(f"proximal_mu must be >= 0, got {proximal_mu}")


class Trainer:
    """Trains the initializers of an ONNX model in numpy.

    Args:
        model: path, bytes or ModelProto (checked with ``load_model``).
        loss: "cross_entropy" (logits + class indices or probabilities), "mse",
            "bce" (logits), "bce_probs"; ``loss_options`` go to the loss kernel
            (e.g. ``{"label_smoothing": 0.1}``).
        optimizer: "sgd", "adam", "adamw", or an :class:`Optimizer`.
        lr, momentum, weight_decay, nesterov: optimizer settings (PyTorch defaults).
        trainable: names or name prefixes to train (default: every float weight).
        freeze: names or prefixes never to train (applied after ``trainable``).
        batch_size, epochs: defaults for :meth:`fit`.
        seed: fixes shuffling and Dropout masks: same seed, same data, same result.
        clip_norm: clip gradients to this global L2 norm.
        proximal_mu: FedProx: add mu * (w - w_anchor) to every gradient (anchor =
            the weights at the start of each ``fit``, i.e. the round's global model).
        qat: quantization-aware training (True or a :class:`~edgeflow.train.qat.QATConfig`).
        profile: a device profile (name, path or DeviceProfile): checks ``can_train``,
            uses its thread count, and plans the step against its training budget.
        grad_accumulation: when the batch does not fit the budget, run micro-batches
            and accumulate (else a MemoryBudgetError says what fits).
        output / input: which model output is the loss input / which input a plain-array ``x``
            feeds (needed for a plain ``x`` when the model has several inputs; or give ``x`` as a
            dict of per-sample arrays keyed by input name).
        feeds: fixed arrays by input name, fed unchanged to every step (inputs the data does not carry).
        compact_activations: keep what a backward reads of a piecewise op's input (HardSwish,
            HardSigmoid) in 8 bits (float16 where the op's output is recomputed from it) instead of
            float: less memory, gradients within a stated bound of the exact ones (docs/training.md).
            None (default): on in the modes whose point is memory (head, bias, last:N, sparse), off
            in full mode and without a mode; False: exact, bit for bit.
        dtype: compute dtype ("float32"; "float64" for gradient checks).
    """

    def __init__(
        self,
        model: ModelSource,
        *,
        loss: str | Loss = "cross_entropy",
        optimizer: str | Optimizer = "sgd",
        lr: float | None = None,
        momentum: float = 0.0,
        weight_decay: float | None = None,
        nesterov: bool = False,
        trainable: Sequence[str] | None = None,
        freeze: Sequence[str] = (),
        batch_size: int = 32,
        epochs: int = 1,
        seed: int = 0,
        clip_norm: float | None = None,
        proximal_mu: float = 0.0,
        qat: Any = None,
        profile: "str | os.PathLike | DeviceProfile | None" = None,
        grad_accumulation: bool = False,
        output: str | None = None,
        input: str | None = None,  # noqa: A002
        dtype: str | np.dtype = "float32",
        loss_options: Mapping[str, Any] | None = None,
        save_workspace: bool = True,
        mode: "str | Mode | None" = None,
        blocks: int | None = None,
        budget_bytes: int | None = None,
        bn_training: bool | None = None,
        feeds: Mapping[str, np.ndarray] | None = None,
        compact_activations: bool | None = None,
    ) -> None:
        _check_settings(batch_size, epochs, clip_norm, proximal_mu)
        self._load(model, mode, blocks)
        self._set_settings(dtype, batch_size, epochs, seed, clip_norm, proximal_mu, grad_accumulation)
        self._set_loss_and_optimizer(loss, loss_options, optimizer, lr, momentum, weight_decay, nesterov)
        self._bind_inputs(input, dict(feeds or {}))
        self._bind_output(output, logits_for_mode=mode is not None)
        self._set_budget(profile, budget_bytes)
        self._choose_trainable(trainable, freeze, bn_training, compact_activations)
        self._build_tape(save_workspace)
        self._report_trainable(announce_mode=mode is not None)
        self.n_classes = self._output_classes()
        self._set_qat(qat)
        self._fit_step_to_budget()
        self._start_counters()

    # ------------------------------------------------------------ construction steps

    def _load(self, model: ModelSource, mode: "str | Mode | None", blocks: int | None) -> None:
        """The checked model, its training mode and its compiled graph (no control flow)."""
        self.model = prepare_model(load_model(model))  # Constant-node weights -> initializers
        self.mode = parse_mode(mode, blocks)
        self.graph = fuse_hardswish(compile_graph(self.model, optimize=False))
        refuse_control_flow(self.graph)

    def _set_settings(self, dtype: str | np.dtype, batch_size: int, epochs: int, seed: int,
                      clip_norm: float | None, proximal_mu: float, grad_accumulation: bool) -> None:
        self.dtype = np.dtype(dtype)
        if self.dtype.kind != "f":
            raise InputError(f"dtype must be a float type, got {self.dtype}")
        self.batch_size = int(batch_size)
        self.epochs = int(epochs)
        self.seed = int(seed)
        self.clip_norm = clip_norm
        self.proximal_mu = float(proximal_mu)
        self.grad_accumulation = grad_accumulation

    def _set_loss_and_optimizer(self, loss: str | Loss, loss_options: Mapping[str, Any] | None,
                                optimizer: str | Optimizer, lr: float | None, momentum: float,
                                weight_decay: float | None, nesterov: bool) -> None:
        self.loss = loss if isinstance(loss, Loss) else get_loss(loss, **dict(loss_options or {}))
        self.optimizer = optimizer if isinstance(optimizer, Optimizer) else make_optimizer(
            optimizer, lr, momentum=momentum, weight_decay=weight_decay, nesterov=nesterov)

    def _bind_inputs(self, name: str | None, feeds: dict[str, Any]) -> None:
        """The model's inputs (per-sample ones freed of a fixed batch), the one a plain ``x`` feeds, and ``feeds``."""
        self.inputs = {t.name: t for t in self.graph.inputs}
        check_known(feeds, list(self.inputs), "feeds=")
        self.fixed_batch = _fixed_batch([t for t in self.graph.inputs if t.name not in feeds])
        """The batch the exported graph fixes on its per-sample inputs (None: free): steps then run in
        micro-batches of exactly that size with gradient accumulation, and the data may hold any number of
        samples (issue 30: a model exported with batch 1 could not be trained)."""
        if self.fixed_batch:
            self.inputs = {k: (replace(t, shape=(None, *t.shape[1:])) if k not in feeds else t)
                           for k, t in self.inputs.items()}
        self.input_name, self.input_shape = self._pick_input(name)
        self.feeds: dict[str, np.ndarray] = {k: convert(k, v, self.inputs[k], self.dtype)
                                             for k, v in feeds.items()}

    def _bind_output(self, output: str | None, *, logits_for_mode: bool) -> None:
        """The value the loss reads: ``output``, the only output, or (a mode and a classifying loss) its logits."""
        if output is None and len(self.graph.output_names) > 1:
            shapes = {o.name: o.shape for o in self.graph.outputs}
            listed = ", ".join(f"{n} {list(shapes.get(n, ()))}" for n in self.graph.output_names)
            raise TrainingError(f"the model has {len(self.graph.output_names)} outputs ({listed}): name the one the "
                                "labels train with output= (--target NAME); training the first one silently could "
                                "train a box regressor on class labels")
        self.output_name = output or self.graph.output_names[0]
        if (output is None or output in self.graph.output_names) and logits_for_mode and self.loss.classifies:
            self.output_name = logits_of(self.graph, self.output_name)  # cross-entropy wants the logits
        produced = {o for n in self.graph.nodes for o in n.outputs if o}
        if self.output_name not in produced:
            raise TrainingError(
                f"{self.output_name!r} is not a value of the model; outputs: {self.graph.output_names} "
                "(an intermediate value such as the logits before a final Softmax may be named too)"
            )

    def _set_budget(self, profile: "str | os.PathLike | DeviceProfile | None", budget_bytes: int | None) -> None:
        """The device profile and the step's memory budget (``budget_bytes``, else the profile's)."""
        self.profile = get_profile(profile) if profile is not None else None
        self.budget_bytes = (int(budget_bytes) if budget_bytes is not None else
                             self.profile.train_memory_budget_bytes if self.profile is not None else None)

    def _choose_trainable(self, trainable: Sequence[str] | None, freeze: Sequence[str],
                          bn_training: bool | None, compact_activations: bool | None) -> None:
        """The layers, how activations and BatchNorm train in this mode, and the weights that train."""
        self.layers = find_layers(self.graph, self._candidates(), self.output_name)
        self.sparse_k: int | None = None
        self._set_activation_options(bn_training, compact_activations)
        if self.mode.name == "sparse":
            self.sparse_k = self._fit_sparse(trainable, freeze)
        self.trainable_names = self._select_trainable(trainable, freeze)

    def _set_activation_options(self, bn_training: bool | None, compact_activations: bool | None) -> None:
        self._bn_given = bn_training
        if compact_activations not in (None, True, False):
            raise InputError(f"compact_activations takes True, False or None (the mode's default), "
                             f"got {compact_activations!r}")
        self._compact_given = compact_activations
        self.compact_activations = self._compact_for(self.mode)
        self.bn_training = (self.mode.name == "full") if bn_training is None else bool(bn_training)

    def _build_tape(self, save_workspace: bool) -> None:
        """Copies of the trainable weights in the compute dtype, the rest as constants, and the tape over them."""
        inits = self.graph.initializers
        self._orig_dtypes = {n: a.dtype for n, a in inits.items()}
        self.params: dict[str, np.ndarray] = {
            n: np.array(inits[n], dtype=self.dtype, order="C", copy=True) for n in self.trainable_names
        }
        constants = {
            n: (np.array(a, dtype=self.dtype) if a.dtype.kind == "f" else a)
            for n, a in inits.items() if n not in self.params
        }
        self.tape = Tape(self.graph, set(self.trainable_names), self.output_name,
                         save_workspace=save_workspace, constants=constants, bn_training=self.bn_training,
                         compact_activations=self.compact_activations)

    def _report_trainable(self, *, announce_mode: bool) -> None:
        """Log what the mode trains (when one was given) and warn of weights that cannot change."""
        if announce_mode:
            log.info("mode %s: %s", self.mode, self.describe_trainable())
        unused = sorted(set(self.trainable_names) - self.tape.reaches_target)
        if unused:
            log.warning("trainable weight(s) %s do not influence output %s; they will not change",
                        unused, self.output_name)

    def _set_qat(self, qat: Any) -> None:
        self.qat = None
        if qat:
            from .qat import FakeQuantizer, QATConfig

            cfg = qat if isinstance(qat, QATConfig) else QATConfig()
            self.qat = FakeQuantizer(self.tape, cfg, self.trainable_names)

    def _fit_step_to_budget(self) -> None:
        """The micro-batch a step runs in: the fixed batch, the batch, or what the profile's budget allows."""
        self.micro_batch = self.fixed_batch or self.batch_size
        self.memory: BudgetDecision | None = None
        if self.profile is not None:
            self._apply_profile(self.profile)

    def _start_counters(self) -> None:
        self._rng = np.random.default_rng(self.seed)
        self.skipped_samples = 0
        """Samples left out because a batch was not a multiple of :attr:`fixed_batch`."""
        self.global_step = 0
        self.last_gradients: dict[str, np.ndarray] = {}
        self._pending_state: dict[str, np.ndarray] = {}

    # ------------------------------------------------------------ construction helpers

    def _pick_input(self, name: str | None) -> tuple[str | None, tuple | None]:
        ins = list(self.inputs.values())
        if name is None:
            if len(ins) != 1:
                return None, None  # x must be a dict by input name (or input= names the one it feeds)
            return ins[0].name, tuple(ins[0].shape)
        for i in ins:
            if i.name == name:
                return i.name, tuple(i.shape)
        raise TrainingError(f"model has no input {name!r}; inputs: {[i.name for i in ins]}")

    def _candidates(self) -> list[str]:
        """Float initializers fed to at least one differentiable input slot."""
        inits = self.graph.initializers
        found: dict[str, None] = {}
        for node in self.graph.nodes:
            nd = NON_DIFFERENTIABLE_INPUTS.get(node.op_type, frozenset()) if not node.domain else frozenset()
            for pos, x in enumerate(node.inputs):
                if x in inits and inits[x].dtype.kind == "f" and pos not in nd:
                    found[x] = None
        return list(found)

    def _select_trainable(self, trainable: Sequence[str] | None, freeze: Sequence[str]) -> list[str]:
        cands = self._candidates()
        if isinstance(trainable, str) or isinstance(freeze, str):
            raise InputError("trainable and freeze take a list of names or prefixes, e.g. freeze=['conv']")
        if trainable is None:
            chosen = select(self.mode, self.layers, cands, sparse_k=self.sparse_k)
        else:
            bad = [p for p in trainable if not any(_matches(c, [p]) for c in cands)]
            if bad:
                raise TrainingError(f"trainable pattern(s) {bad} match no weight; weights: {cands}")
            chosen = [c for c in cands if _matches(c, trainable)]
        bad = [p for p in freeze if not any(_matches(c, [p]) for c in cands)]
        if bad:
            raise TrainingError(f"freeze pattern(s) {bad} match no weight; weights: {cands}")
        chosen = [c for c in chosen if not _matches(c, freeze)]
        if not chosen:
            raise TrainingError("no weight is left to train: loosen trainable= / freeze=")
        return chosen

    def describe_trainable(self) -> str:
        """Which tensors train: '3 of 146 weight tensors train (5,124 values): ...'."""
        return describe(self.trainable_names, self.graph.initializers, len(self._candidates()))

    def _compact_for(self, mode: Mode) -> bool:
        """Whether ``mode`` keeps piecewise ops' inputs compactly: as given, else its default."""
        return self._compact_given if self._compact_given is not None else mode.name != "full"

    def _plan_for(self, names: Sequence[str], batch_size: int, bn_training: bool | None = None,
                  compact: bool | None = None) -> TrainingMemoryPlan:
        """Planned step memory if ``names`` trained (a throw-away tape; nothing runs)."""
        bn_training = self.bn_training if bn_training is None else bn_training
        compact = self.compact_activations if compact is None else compact
        inits = self.graph.initializers
        consts = {n: (np.asarray(a, dtype=self.dtype) if a.dtype.kind == "f" else a)
                  for n, a in inits.items() if n not in names}
        tape = Tape(self.graph, set(names), self.output_name, constants=consts, bn_training=bn_training,
                    compact_activations=compact)
        nbytes = sum(int(inits[n].size) * self.dtype.itemsize for n in names)
        return plan_training_step(tape, batch_size, trainable_bytes=nbytes, optimizer_slots=self.optimizer.slots,
                                  itemsize=self.dtype.itemsize)

    def _fit_sparse(self, trainable, freeze) -> int:
        if self.budget_bytes is None:
            raise InputError("mode 'sparse' chooses what trains from a memory budget: give profile= "
                             "(--profile) or budget_bytes= (--budget-mib)")
        if not self.layers:
            raise TrainingError("mode 'sparse' found no Conv/Gemm/MatMul layer with a weight initializer")
        cands = self._candidates()

        def fits(k: int) -> bool:
            names = [c for c in select(Mode("sparse"), self.layers, cands, sparse_k=k) if not _matches(c, freeze)]
            return bool(names) and self._plan_for(names, self.batch_size).peak_bytes <= self.budget_bytes

        k = largest_fitting(fits, len(self.layers))
        if k is None:
            head = select(Mode("head"), self.layers, cands)
            plan = self._plan_for(head, self.batch_size)
            raise MemoryBudgetError(
                f"mode 'sparse': even the head alone needs {plan.describe()}, over the training budget of "
                f"{self.budget_bytes / 2**20:.1f} MiB; lower batch_size or train on a board with more memory",
                planned_bytes=plan.peak_bytes, budget_bytes=self.budget_bytes)
        return k

    def modes_that_fit(self, budget_bytes: int, batch_size: int | None = None) -> list[tuple[str, int]]:
        """(mode, planned peak bytes) of the modes cheaper than full whose step fits ``budget_bytes``."""
        cands = self._candidates()
        out = []
        for m in (Mode("bias"), Mode("head")):
            if m == self.mode:
                continue
            try:
                names = select(m, self.layers, cands)
            except TrainingError:
                continue
            # as that mode would run: frozen BatchNorm statistics unless bn_training= was given
            bn = self._bn_given if self._bn_given is not None else m.name == "full"
            peak = self._plan_for(names, batch_size or self.batch_size, bn, self._compact_for(m)).peak_bytes
            if peak <= budget_bytes:
                out.append((str(m), peak))
        return out

    def _output_classes(self) -> int | None:
        out = next((o for o in self.graph.outputs if o.name == self.output_name), None)
        if out is None:
            return None  # an intermediate value: checked against the first forward's width
        if len(out.shape) >= 2 and isinstance(out.shape[1], int) and out.shape[1] > 0:
            return int(out.shape[1])
        return None

    def _apply_profile(self, profile: DeviceProfile) -> None:
        if not profile.can_train:
            raise TrainingError(
                f"profile {profile.name!r} does not train (can_train = false): train on another board "
                "or only run inference here"
            )
        from ..runtime.backends.numpy_backend import _set_blas_threads

        _set_blas_threads(profile.threads)
        budget = self.budget_bytes if self.budget_bytes is not None else profile.train_memory_budget_bytes
        try:
            decision = fit_budget(
                lambda m, save: self.plan_memory(m, save_workspace=save), self.batch_size,
                budget, allow_accumulation=self.grad_accumulation, profile_name=profile.name,
            )
        except MemoryBudgetError as e:
            fit = self.modes_that_fit(budget) if self.layers else []
            if not fit:
                raise
            hint = ", ".join(f"mode={m!r} ({b / 2**20:.1f} MiB)" for m, b in fit)
            raise MemoryBudgetError(
                f"mode {str(self.mode)!r} needs {e.planned_bytes / 2**20:.1f} MiB per step at batch "
                f"{self.batch_size}, over profile {profile.name!r}'s training budget of {budget / 2**20:.1f} MiB; "
                f"fits: {hint}", planned_bytes=e.planned_bytes, budget_bytes=budget) from None
        self.memory = decision
        self.micro_batch = self.fixed_batch or decision.micro_batch
        self.tape.set_save_workspace(decision.save_workspace)
        if decision.micro_batch < self.batch_size:
            log.info("batch %d does not fit %s: micro-batches of %d with gradient accumulation",
                     self.batch_size, profile.name, decision.micro_batch)

    def plan_memory(self, batch_size: int | None = None, *, save_workspace: bool | None = None) -> TrainingMemoryPlan:
        """Planned peak memory of one step at ``batch_size`` (default: the trainer's)."""
        keep = self.tape.save_workspace
        if save_workspace is not None:
            self.tape.set_save_workspace(save_workspace)
        try:
            nbytes = sum(int(p.nbytes) for p in self.params.values())
            return plan_training_step(self.tape, batch_size or self.batch_size, trainable_bytes=nbytes,
                                      optimizer_slots=self.optimizer.slots, itemsize=self.dtype.itemsize)
        finally:
            self.tape.set_save_workspace(keep)

    # ------------------------------------------------------------ validation

    def _plain_input(self) -> str:
        if self.input_name is None:
            names = list(self.inputs)
            raise TrainingError(f"the model has {len(names)} inputs {names}; give x as a dict keyed by input "
                                "name, or name the one x feeds with input= (--input) and the others with feeds=")
        return self.input_name

    def _batch_feeds(self, x: Any) -> tuple[dict[str, np.ndarray], int]:
        """Per-sample arrays by input name (checked and cast) and their number of samples."""
        if isinstance(x, Mapping):
            check_known(x, list(self.inputs))
            batched = {k: convert(k, v, self.inputs[k], self.dtype) for k, v in x.items()}
            n = batch_len(batched)
        else:
            name = self._plain_input()
            a = np.asarray(x)
            batched = {name: convert(name, a, self.inputs[name], self.dtype)}
            n = len(a)
        self._require_fed(batched)
        return batched, n

    def _require_fed(self, batched: Mapping[str, Any]) -> None:
        missing = [k for k in self.inputs if k not in batched and k not in self.feeds]
        if missing:
            raise TrainingError(missing_message(missing, list(self.inputs)))

    def _feed(self, batched: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        return {**self.feeds, **batched}

    def _check_batch(self, x: Any, y: np.ndarray) -> tuple[dict[str, np.ndarray], np.ndarray]:
        x, n = self._batch_feeds(x)
        y = np.asarray(y)
        if n != len(y):
            raise ShapeError(f"batch has {n} inputs but {len(y)} labels")
        if self.loss.classifies and np.issubdtype(y.dtype, np.integer) and self.n_classes:
            check_labels(y, self.n_classes)
        elif np.issubdtype(y.dtype, np.floating) and y.dtype != self.dtype:
            y = y.astype(self.dtype)
        return x, y

    def _check_dataset(self, d: Dataset) -> None:
        name = self._plain_input()
        check_inputs(d.x, self.input_shape, name)
        self._require_fed({name: d.x})  # every other input is fed by feeds=
        self._check_targets(d.y)

    def _check_targets(self, y: np.ndarray) -> None:
        if self.loss.classifies and np.issubdtype(y.dtype, np.integer):
            if self.n_classes:
                check_labels(y, self.n_classes)
        elif self.loss.classifies and y.ndim != 2:
            raise ShapeError(f"cross-entropy targets must be class indices (N,) or probabilities (N, C); got {y.shape}")

    # ------------------------------------------------------------ one step

    def _grads(self, x: dict[str, np.ndarray], y: np.ndarray, scale: float
               ) -> tuple[float, int | None, dict[str, np.ndarray], dict[str, np.ndarray]]:
        # Overflow shows up as a non-finite loss or gradient, which is checked and
        # reported as a TrainingError; numpy's warnings would only add noise.
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            return self._grads_unchecked(x, y, scale)

    def _grads_unchecked(self, x: dict[str, np.ndarray], y: np.ndarray, scale: float
                         ) -> tuple[float, int | None, dict[str, np.ndarray], dict[str, np.ndarray]]:
        fwd = self.tape.forward(self.params, self._feed(x), seed=self.seed * 7919 + self.global_step)
        out = fwd.output
        if self.n_classes is None and self.loss.classifies and np.issubdtype(y.dtype, np.integer):
            check_labels(y, out.shape[1])
        loss, dout = self.loss.value_and_grad(out, y, scale)
        if not math.isfinite(loss):
            raise TrainingError(
                f"the loss became {loss} at step {self.global_step}; training stopped and the weights are "
                f"those of the last good step. Lower the learning rate (now {self.optimizer.lr:g}), set "
                "clip_norm, or check the data for extreme values"
            )
        grads = self.tape.backward(fwd, dout)
        return loss, self.loss.correct(out, y), grads, fwd.state

    def compute_gradients(self, x: Any, y: np.ndarray) -> tuple[float, int | None, dict[str, np.ndarray]]:
        """Loss, correct count and gradients of the mean loss over a batch (micro-batched if planned).

        ``x``: an array for the trainer's input, or a dict of per-sample arrays by input name.
        """
        x, y = self._check_batch(x, y)
        n = len(y)
        if n == 0:
            raise InputError("empty batch")
        if self.fixed_batch and n % self.fixed_batch:
            # the graph runs only batches of exactly fixed_batch: the remainder of this batch is left out
            n -= n % self.fixed_batch
            if n == 0:
                raise TrainingError(f"a batch of {len(y)} sample(s) is smaller than the model's fixed batch of "
                                    f"{self.fixed_batch}: use a batch size that is a multiple of {self.fixed_batch}")
            self.skipped_samples += len(y) - n
            x, y = {k: v[:n] for k, v in x.items()}, y[:n]
        total_loss, total_correct = 0.0, 0
        grads: dict[str, np.ndarray] = {}
        states: dict[str, np.ndarray] = {}
        m = self.micro_batch
        for start in range(0, n, m):
            xb, yb = {k: v[start:start + m] for k, v in x.items()}, y[start:start + m]
            w = len(yb) / n
            loss, correct, g, state = self._grads(xb, yb, w)
            total_loss += w * loss
            total_correct = None if correct is None or total_correct is None else total_correct + correct
            if not grads:
                grads = g
            else:
                for k, v in g.items():
                    grads[k] += v
            states.update(state)
            if len(range(0, n, m)) > 1:
                self._apply_state(state)  # each micro-batch updates the running stats in turn
        self._pending_state = states if m >= n else {}
        return total_loss, total_correct, grads

    def gradients(self, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
        """Gradients of the loss on one batch as named float32 arrays; weights unchanged."""
        _, _, g = self.compute_gradients(x, y)
        self._pending_state = {}
        return {k: v.astype(np.float32) for k, v in g.items()}

    def _apply_state(self, state: dict[str, np.ndarray]) -> None:
        for buf, value in state.items():
            self.tape.constants[buf] = value

    def step(self, x: np.ndarray, y: np.ndarray, *, anchor: dict[str, np.ndarray] | None = None) -> StepResult:
        """One optimizer step on a batch (forward, backward, clip, update)."""
        loss, correct, grads = self.compute_gradients(x, y)
        if self.proximal_mu and anchor is not None:
            mu = self.dtype.type(self.proximal_mu)
            grads = {k: g + mu * (self.params[k] - anchor[k]) for k, g in grads.items()}
        with np.errstate(over="ignore", invalid="ignore"):
            norm = global_norm(grads)
        if not math.isfinite(norm):
            raise TrainingError(
                f"a gradient became non-finite at step {self.global_step} (norm {norm}); training stopped and "
                "the weights are those of the last good step. Lower the learning rate or set clip_norm"
            )
        if self.clip_norm:
            grads, norm = clip_by_global_norm(grads, self.clip_norm, norm)
        self.optimizer.step(self.params, grads)
        self._apply_state(self._pending_state)
        self.last_gradients = grads
        self.global_step += 1
        return StepResult(loss, correct, len(y), norm)

    # ------------------------------------------------------------ epochs

    def fit(
        self,
        data: Any,
        epochs: int | None = None,
        *,
        batch_size: int | None = None,
        shuffle: bool = True,
        validation: "Dataset | tuple[np.ndarray, np.ndarray] | None" = None,
        on_batch: Callable[[StepResult], None] | None = None,
        on_epoch: Callable[[EpochStats], None] | None = None,
        anchor: Mapping[str, np.ndarray] | None = None,
    ) -> History:
        """Train ``epochs`` passes over ``data``: (x, y) arrays, a Dataset, a .npz path,
        a DataLoader, or a callable/iterator of (x, y) chunks."""
        epochs = self.epochs if epochs is None else int(epochs)
        if epochs < 0:
            raise InputError(f"epochs must be >= 0, got {epochs}")
        if isinstance(data, (str, os.PathLike)) and len(self.inputs) > 1:  # one array per input name + y
            data = read_split(data, self.graph.inputs, input_name=self.input_name)
        by_name = None  # x as a dict of per-sample arrays: batches of sample indices, gathered below
        if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], Mapping):
            by_name, n = self._batch_feeds(data[0])
            y_all = labels(data[1], self.dtype)
            if n != len(y_all):
                raise ShapeError(f"x has {n} samples but y has {len(y_all)}; they must match")
            self._check_targets(y_all)
            data = Dataset(np.arange(n), y_all)
        elif isinstance(data, tuple) and len(data) == 2:
            data = from_arrays(*data, dtype=self.dtype)
        loader = as_loader(data, batch_size or self.batch_size, shuffle=shuffle,
                           seed=int(self._rng.integers(2**31)))
        if loader.dataset is not None and by_name is None:
            self._check_dataset(loader.dataset)
        val = None
        if validation is not None:
            if isinstance(validation, tuple) and len(validation) == 2 and isinstance(validation[0], Mapping):
                val = validation  # checked by evaluate
            else:
                val = validation if isinstance(validation, Dataset) else from_arrays(*validation, dtype=self.dtype)
                self._check_dataset(val)
        prox_anchor = None
        if self.proximal_mu:
            src = anchor if anchor is not None else self.params
            prox_anchor = {k: np.array(src[k], dtype=self.dtype) for k in self.params}
        history = History()
        for epoch in range(epochs):
            t0 = time.perf_counter()
            loss_sum, correct_sum, seen, steps = 0.0, 0, 0, 0
            scored = True
            for xb, yb in loader:
                if by_name is not None:
                    xb = {k: v[xb] for k, v in by_name.items()}
                r = self.step(xb, yb, anchor=prox_anchor)
                loss_sum += r.loss * r.samples
                if r.correct is None:
                    scored = False
                else:
                    correct_sum += r.correct
                seen += r.samples
                steps += 1
                if on_batch:
                    on_batch(r)
            if seen == 0:
                raise InputError("the data yielded no samples")
            stats = EpochStats(epoch + 1, loss_sum / seen, correct_sum / seen if scored else None, seen, steps,
                               time.perf_counter() - t0)
            if val is not None:
                vl, va = self.evaluate(*val) if isinstance(val, tuple) else self.evaluate(val.x, val.y)
                stats = EpochStats(**{**asdict(stats), "val_loss": vl, "val_accuracy": va})
            history.epochs.append(stats)
            if on_epoch:
                on_epoch(stats)
        return history

    # ------------------------------------------------------------ inference

    def predict(self, x: Any, *, batch_size: int = 256) -> np.ndarray:
        """The target output in inference mode (running BatchNorm stats, no Dropout)."""
        feeds, n = self._batch_feeds(x)
        batch_size = self.fixed_batch or batch_size
        outs = [self._infer({k: v[i:i + batch_size] for k, v in feeds.items()}) for i in range(0, n, batch_size)]
        return np.concatenate(outs) if outs else np.zeros((0,), self.dtype)

    def _infer(self, xb: dict[str, np.ndarray]) -> np.ndarray:
        """The target output for one chunk; a chunk shorter than the model's fixed batch is padded with
        copies of its last sample, and the padding's outputs dropped."""
        n = batch_len(xb)
        if self.fixed_batch and n < self.fixed_batch:
            pad = self.fixed_batch - n
            xb = {k: np.concatenate([v, np.repeat(v[-1:], pad, axis=0)]) for k, v in xb.items()}
            return self.tape.infer(self.params, self._feed(xb))[:n]
        return self.tape.infer(self.params, self._feed(xb))

    def evaluate(self, x: np.ndarray, y: np.ndarray, *, batch_size: int = 256) -> tuple[float, float | None]:
        """(mean loss, accuracy) in inference mode; accuracy is None for regression losses."""
        x, y = self._check_batch(x, y)
        if len(y) == 0:
            raise InputError("cannot evaluate on zero samples")
        loss_sum, correct, scored = 0.0, 0, True
        batch_size = self.fixed_batch or batch_size
        for i in range(0, len(y), batch_size):
            xb, yb = {k: v[i:i + batch_size] for k, v in x.items()}, y[i:i + batch_size]
            out = self._infer(xb)
            loss_sum += self.loss.value(out, yb) * len(yb)
            c = self.loss.correct(out, yb)
            if c is None:
                scored = False
            else:
                correct += c
        return loss_sum / len(y), (correct / len(y) if scored else None)

    # ------------------------------------------------------------ weights (federated API)

    @functools.cached_property
    def weight_names(self) -> list[str]:
        """Trainable and frozen weights plus BatchNorm running statistics (model order).

        Constants such as a Dropout ratio or Clip bounds are not weights: they
        never change, so a federated delta would only carry zeros for them.
        """
        keep = set(self._candidates()) | {buf for st in self.tape.steps for _, buf in st.state_updates}
        return [n for n in self.graph.initializers if n in keep]

    def _value(self, name: str) -> np.ndarray:
        return self.params[name] if name in self.params else self.tape.constants[name]

    def get_weights(self, *, trainable_only: bool = False) -> dict[str, np.ndarray]:
        """Copies (float32, or the model's dtype) of the current weights by initializer name."""
        names = self.trainable_names if trainable_only else self.weight_names
        return {n: np.array(self._value(n), dtype=self._orig_dtypes[n]) for n in names}

    def set_weights(self, weights: Mapping[str, np.ndarray], *, strict: bool = False) -> None:
        """Load weights by name (all validated before any is written).

        ``strict`` requires every trainable weight to be present. Optimizer
        state is kept; call ``trainer.optimizer.reset()`` to drop it.
        """
        known = set(self.weight_names)
        unknown = sorted(set(weights) - known)
        if unknown:
            raise InputError(f"unknown weight name(s) {unknown[:5]}; the model's weights are {sorted(known)[:8]}...")
        if strict:
            missing = sorted(set(self.trainable_names) - set(weights))
            if missing:
                raise InputError(f"set_weights(strict=True) is missing trainable weight(s) {missing}")
        staged: dict[str, np.ndarray] = {}
        for name, value in weights.items():
            arr = np.asarray(value)
            want = self._value(name).shape
            if arr.shape != want:
                raise ShapeError(f"weight {name!r} has shape {arr.shape}; the model needs {want}")
            if arr.dtype.kind != "f" or not np.isfinite(arr).all():
                raise InputError(f"weight {name!r} must be finite floats")
            staged[name] = arr
        for name, arr in staged.items():
            if name in self.params:
                np.copyto(self.params[name], arr, casting="unsafe")
            else:
                self.tape.constants[name] = np.array(arr, dtype=self.dtype)

    def delta_from(self, reference: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """current - reference (float32) for every weight named in ``reference``."""
        out: dict[str, np.ndarray] = {}
        known = set(self.weight_names)
        for name, ref in reference.items():
            if name not in known:
                raise InputError(f"unknown weight name {name!r}")
            cur = self._value(name)
            ref = np.asarray(ref)
            if ref.shape != cur.shape:
                raise ShapeError(f"weight {name!r}: reference shape {ref.shape}, current {cur.shape}")
            out[name] = (cur.astype(np.float64) - ref.astype(np.float64)).astype(np.float32)
        return out

    # ------------------------------------------------------------ export

    def to_onnx(self) -> onnx.ModelProto:
        """The model with the trained weights (and BatchNorm running stats) written back."""
        meta = {"steps": self.global_step, "trainable": len(self.trainable_names),
                "optimizer": type(self.optimizer).__name__, "qat": bool(self.qat)}
        return with_weights(self.model, self.get_weights(), metadata=meta)

    def export(self, path: str | os.PathLike) -> None:
        save_model(self.to_onnx(), path)

    # ------------------------------------------------------------ resuming

    def save_state(self, path: str | os.PathLike):
        """Optimizer state, step and trainable weights to ``PATH.npz`` + ``PATH.json`` (no pickle)."""
        from .checkpoint import save_state

        return save_state(self, path)

    def load_state(self, path: str | os.PathLike, *, weights: bool = True) -> dict:
        """Restore :meth:`save_state`'s files (onto an updated base model too, where shapes match)."""
        from .checkpoint import load_state

        return load_state(self, path, weights=weights)
