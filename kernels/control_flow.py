"""Control flow: If, Loop, Scan (opset 8 and 9+), SequenceMap.

These kernels are pure functions like every other one, except that their
graph attributes (``then_branch``, ``else_branch``, ``body``) arrive as
*callables*: ``body(*inputs) -> list of outputs``. Whoever runs the graph
(``edgeflow.runtime.control_flow``) compiles each subgraph once and hands the kernel
a callable bound to the enclosing scope's values, so the kernels know
nothing about graphs, environments or scopes.

A callable may carry ``output_info``: one ``(dtype, shape)`` per subgraph
output (dtype a numpy dtype or None, shape a tuple of ints/None or None).
Loop, Scan and SequenceMap use it only when the body never runs (zero
trips), to give the scan outputs their declared element shape and dtype, as
onnxruntime does.

Loop follows onnxruntime where the spec is loose: the body's condition
output stops the loop even when the node's ``cond`` input is omitted.
"""

from __future__ import annotations

import numpy as np

from .registry import ANY_TYPE, register


def _flag(x, what: str) -> bool:
    a = np.asarray(x)
    if a.size != 1:
        raise ValueError(f"{what} must hold one element, got shape {a.shape}")
    return bool(a.reshape(-1)[0])


def _empty_like_output(body, k: int, lead: tuple[int, ...], axis: int = 0) -> np.ndarray:
    """An empty scan output: declared element shape (unknown dims 0), declared dtype."""
    info = getattr(body, "output_info", None)
    dtype, shape = (info[k] if info and k < len(info) else (None, None))
    elem = [d if isinstance(d, int) and d >= 0 else 0 for d in (shape or ())]
    out_shape = list(elem)
    ax = axis % (len(elem) + 1)
    for i, d in enumerate(lead):
        out_shape.insert(ax + i, d)
    return np.zeros(out_shape, dtype=dtype if dtype is not None else np.float32)


def _n_body_outputs(body) -> int | None:
    info = getattr(body, "output_info", None)
    return None if info is None else len(info)


@register("If", dtypes=ANY_TYPE)
def if_(cond, *, then_branch, else_branch):
    """Run one branch; the branches may return differently shaped outputs."""
    branch = then_branch if _flag(cond, "If's condition") else else_branch
    return tuple(branch())


@register("Loop", dtypes=ANY_TYPE)
def loop(M=None, cond=None, *v_initial, body):
    """``for i in range(M) while cond``: carried values, stacked scan outputs.

    Body inputs: (iteration int64 scalar, condition bool scalar, *carried);
    body outputs: (condition, *carried, *scan_outputs). Each scan output is
    stacked along a new leading axis across iterations.
    """
    if M is not None and np.asarray(M).size != 1:
        raise ValueError(f"Loop's trip count M must hold one element, got shape {np.asarray(M).shape}")
    trip = None if M is None else int(np.asarray(M).reshape(-1)[0])
    go = True if cond is None else _flag(cond, "Loop's condition")
    n = len(v_initial)
    carried = list(v_initial)
    scans: list[list] | None = None
    i = 0
    while go and (trip is None or i < trip):
        out = body(np.array(i, np.int64), np.array(go), *carried)
        go = _flag(out[0], "Loop body's condition output")
        carried = list(out[1:1 + n])
        if scans is None:
            scans = [[] for _ in range(len(out) - 1 - n)]
        for acc, x in zip(scans, out[1 + n:]):
            acc.append(x)
        i += 1
    if scans is None:  # the body never ran
        total = _n_body_outputs(body)
        k = 0 if total is None else total - 1 - n
        return tuple(carried) + tuple(_empty_like_output(body, 1 + n + j, (0,)) for j in range(k))
    return tuple(carried) + tuple(_stack(acc, 0, "Loop") for acc in scans)


def _stack(parts: list, axis: int, op: str) -> np.ndarray:
    try:
        return np.stack(parts, axis=axis)
    except ValueError as exc:
        shapes = sorted({np.shape(p) for p in parts})
        raise ValueError(f"{op} scan output pieces differ in shape across iterations ({shapes}): {exc}") from exc


def _scan_run(states, xs, body, in_axes, in_dirs, n_out: int | None, length: int):
    """One Scan pass over ``length`` steps; returns (final states, per-step output lists)."""
    views = [np.moveaxis(x, ax, 0) if ax else x for x, ax in zip(xs, in_axes)]
    n = len(states)
    outs: list[list] | None = None
    for t in range(length):
        sl = [v[length - 1 - t] if d else v[t] for v, d in zip(views, in_dirs)]
        res = body(*states, *sl)
        states = list(res[:n])
        if outs is None:
            outs = [[] for _ in range(len(res) - n)]
        for acc, y in zip(outs, res[n:]):
            acc.append(y)
    if outs is None:
        outs = [[] for _ in range(0 if n_out is None else n_out - n)]
    return states, outs


def _per_input(values, count: int, default: int, name: str) -> list[int]:
    vals = list(values) if values is not None else []
    if len(vals) > count:
        raise ValueError(f"Scan's {name} has {len(vals)} entries for {count} scan values")
    return [int(v) for v in vals] + [default] * (count - len(vals))


@register("Scan", dtypes=ANY_TYPE, since=9)
def scan(*inputs, body, num_scan_inputs, scan_input_axes=None, scan_input_directions=None,
         scan_output_axes=None, scan_output_directions=None):
    """Iterate the body over slices of the scan inputs, carrying state.

    ``inputs`` = (*initial_states, *scan_inputs). Each step slices every scan
    input along its axis (last-to-first where its direction is 1) and the
    body returns (*states, *scan_output_pieces); the pieces are stacked along
    each output's axis (prepended where its direction is 1).
    """
    m = int(num_scan_inputs)
    if not 0 < m <= len(inputs):
        raise ValueError(f"Scan has {len(inputs)} inputs but num_scan_inputs={m}")
    n = len(inputs) - m
    states, xs = list(inputs[:n]), [np.asarray(x) for x in inputs[n:]]
    in_axes = [a % x.ndim if x.ndim else a for a, x in zip(_per_input(scan_input_axes, m, 0, "scan_input_axes"), xs)]
    in_dirs = _per_input(scan_input_directions, m, 0, "scan_input_directions")
    lengths = {x.shape[a] for x, a in zip(xs, in_axes)}
    if len(lengths) != 1:
        raise ValueError(f"Scan's scan inputs differ in sequence length along their axes: {sorted(lengths)}")
    length = lengths.pop()
    total = _n_body_outputs(body)
    states, outs = _scan_run(states, xs, body, in_axes, in_dirs, total, length)
    k = len(outs)
    out_axes = _per_input(scan_output_axes, k, 0, "scan_output_axes")
    out_dirs = _per_input(scan_output_directions, k, 0, "scan_output_directions")
    result = list(states)
    for j, (acc, ax, d) in enumerate(zip(outs, out_axes, out_dirs)):
        if not acc:
            result.append(_empty_like_output(body, n + j, (0,), ax))
            continue
        result.append(_stack(acc[::-1] if d else acc, ax, "Scan"))
    return tuple(result)


@register("Scan", dtypes=ANY_TYPE, since=8)
def scan8(sequence_lens=None, *inputs, body, num_scan_inputs, directions=None):
    """Scan-8: every input has a leading batch axis, scan inputs [batch, seq, ...].

    Batch entry b runs ``sequence_lens[b]`` steps (all of them when omitted);
    its scan outputs are written in step order and zero-padded to the longest
    sequence, as onnxruntime does.
    """
    m = int(num_scan_inputs)
    if not 0 < m <= len(inputs):
        raise ValueError(f"Scan has {len(inputs)} inputs but num_scan_inputs={m}")
    n = len(inputs) - m
    arrays = [np.asarray(x) for x in inputs]
    batches = {a.shape[0] if a.ndim else None for a in arrays}
    if len(batches) != 1 or None in batches:
        raise ValueError(f"Scan-8 inputs must share a leading batch axis, got shapes {[a.shape for a in arrays]}")
    batch = batches.pop()
    seqs = {a.shape[1] if a.ndim > 1 else None for a in arrays[n:]}
    if len(seqs) != 1 or None in seqs:
        raise ValueError(f"Scan-8 scan inputs must share a sequence axis 1, got shapes {[a.shape for a in arrays[n:]]}")
    max_len = seqs.pop()
    if sequence_lens is None:
        lens = [max_len] * batch
    else:
        lens = [int(v) for v in np.asarray(sequence_lens).reshape(-1)]
        if len(lens) != batch or any(not 0 <= v <= max_len for v in lens):
            raise ValueError(f"Scan-8 sequence_lens {lens} must give one length in [0, {max_len}] per batch entry")
    dirs = _per_input(directions, m, 0, "directions")
    total = _n_body_outputs(body)
    final_states: list[list] = [[] for _ in range(n)]
    per_batch_outs: list[list[list]] = []
    for b in range(batch):
        states, outs = _scan_run([a[b] for a in arrays[:n]], [a[b, :lens[b]] for a in arrays[n:]], body,
                                 [0] * m, dirs, total, lens[b])
        for acc, s in zip(final_states, states):
            acc.append(s)
        per_batch_outs.append(outs)
    result = [np.stack(acc) for acc in final_states]
    k = max((len(o) for o in per_batch_outs), default=0)
    for j in range(k):
        pieces = [o[j] for o in per_batch_outs if o[j]]
        if pieces:
            elem = np.asarray(pieces[0][0])
            out = np.zeros((batch, max_len) + elem.shape, elem.dtype)
            for b, o in enumerate(per_batch_outs):
                if o[j]:
                    out[b, :len(o[j])] = _stack(o[j], 0, "Scan")
        else:
            out = _empty_like_output(body, n + j, (batch, max_len))
        result.append(out)
    return tuple(result)


@register("SequenceMap", dtypes=ANY_TYPE, since=17)
def sequence_map(input_sequence, *additional_inputs, body):
    """Apply the body to each element (sequence inputs zipped, tensors repeated)."""
    count = len(input_sequence)
    for a in additional_inputs:
        if isinstance(a, list) and len(a) != count:
            raise ValueError(f"SequenceMap's sequences differ in length ({count} and {len(a)})")
    outs: list[list] | None = None
    for i in range(count):
        args = [input_sequence[i]] + [a[i] if isinstance(a, list) else a for a in additional_inputs]
        res = body(*args)
        if outs is None:
            outs = [[] for _ in res]
        for acc, y in zip(outs, res):
            acc.append(y)
    if outs is None:
        outs = [[] for _ in range(_n_body_outputs(body) or 1)]
    return tuple(outs)
