"""GPTQ with static group scales (gptq_core.GptqOptions) for integer codes, its column loop
run on the host with numpy, for the weights that share one input at once.

Why a second loop beside gptq_core's: GPTQ visits the columns one by one, each a handful of
small vector operations. In an XLA while loop every step pays the loop's and each kernel's
dispatch on the CPU (~0.9 ms a column for a 576 × 1536 weight on the 2-core VM, under load);
numpy's loop over a row-major transposed copy pays ~0.3 ms. And the weights a language model
feeds one input to (q/k/v, gate/up) share H and so its inverse factor and column order: one
loop over their stacked rows does them all (rows never interact in GPTQ).

Arithmetic, float32 throughout, as gptq_core's: code = clip(rint(w / s (+ zp)), qmin, qmax),
ŵ = (code − zp) · s, the error (w − ŵ) / Hinv_ii pushed onto the later columns of the block,
then the block's error onto the rest (a matrix product: BLAS, whose summation order may differ
between CPUs in the last bit — as XLA's dot does).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import threadpoolctl
from scipy.linalg import lapack

from qmill.engine.contrib import gptq_core
from qmill.engine.core import qarray, qtypes


def supports(how: qarray.HowToQuantize) -> bool:
    """Integer qtypes only (a float or lookup grid rounds otherwise)."""
    return qtypes.get(how.qtype).kind == qtypes.INT


def _limits(qt: qtypes.QType, asymmetric: bool) -> tuple[float, float]:
    if asymmetric and qt.asymmetric_range is not None:
        return float(qt.asymmetric_range[0]), float(qt.asymmetric_range[1])
    return float(qt.qmin), float(qt.qmax)


def quantize_shared_input(
    weights: Sequence[jax.Array],
    hessian: jax.Array,
    how: qarray.HowToQuantize,
    options: gptq_core.GptqOptions,
) -> list[tuple[qarray.QArray, np.ndarray]]:
    """GPTQs weights (rows_i, columns) that take the same input, whose Hessian is `hessian`.

    Returns, per weight: (its QArray: codes (rows, columns), scale (rows, groups) in the
    weight's dtype; its per-element losses (w − ŵ)² / (2 Hinv_ii²)).

    Raises:
      ValueError: a non-integer qtype (use gptq_core.quantize_weight_static), shapes that
        don't match, or a group size not dividing the columns.
    """
    if not supports(how):
        raise ValueError(f"the host GPTQ loop takes integer qtypes, not {how.qtype}")
    columns = weights[0].shape[1]
    if any(w.shape[1] != columns for w in weights) or hessian.shape != (columns, columns):
        shapes = [tuple(w.shape) for w in weights]
        raise ValueError(f"weights {shapes} and Hessian {hessian.shape} do not share columns")
    groupsize = gptq_core._groupsize(how, columns)
    qt = qtypes.get(how.qtype)
    parts = [_prepare(w, groupsize, how) for w in weights]
    scale = np.concatenate([p[0] for p in parts])
    zero_point = None if parts[0][1] is None else np.concatenate([p[1] for p in parts])
    w = np.concatenate([np.asarray(x, np.float32) for x in weights])
    diag = np.diag(np.asarray(hessian, np.float32))
    perm = np.argsort(-diag, kind="stable") if options.actorder else np.arange(columns)
    hinv, dead = _factor(np.asarray(hessian)[np.ix_(perm, perm)], options.percdamp)
    group = perm // groupsize
    wt = np.ascontiguousarray(np.where(dead[:, None], 0.0, w[:, perm].T), np.float32)
    st = np.ascontiguousarray(scale[:, group].T)
    zt = None if zero_point is None else np.ascontiguousarray(zero_point[:, group].T)
    # One BLAS thread: the loop's products are small (16 x rows at a time) and a second
    # OpenBLAS thread costs more in hand-offs than it computes (2.3x slower on the 2-core VM).
    with threadpoolctl.threadpool_limits(1, user_api="blas"):
        codes, losses = _loop(wt, hinv, st, zt, _limits(qt, zero_point is not None), options)
    inverse = np.argsort(perm)
    codes, losses = codes[inverse].T, losses[inverse].T
    out, row = [], 0
    for x, (s, zp) in zip(weights, parts, strict=True):
        rows = x.shape[0]
        qvalue = jnp.asarray(codes[row : row + rows]).astype(qt.storage)
        zp_part = None if zp is None else jnp.asarray(zp)
        q = qarray.QArray(qvalue, jnp.asarray(s).astype(x.dtype), zp_part, how.qtype)
        out.append((q, losses[row : row + rows]))
        row += rows
    return out


def _prepare(w: jax.Array, groupsize: int, how: qarray.HowToQuantize):
    """(scale (rows, groups) float32 as stored in w's dtype, zero point or None) of w as it is."""
    scale, zp = _static_scales(jnp.asarray(w), groupsize=groupsize, how=how)
    return np.asarray(scale, np.float32), None if zp is None else np.asarray(zp, np.float32)


def _factor(h: jax.Array, percdamp: float) -> tuple[np.ndarray, np.ndarray]:
    """(upper Cholesky factor of (H + damping)⁻¹, dead columns), as gptq_core's
    _inverse_hessian_factor, with LAPACK's float32 routines (XLA:CPU expands the triangular
    solves into loops: ~3x slower for 1536 columns)."""
    h = np.array(h, np.float32)
    diag = np.diag(h).copy()
    dead = diag == 0
    index = np.arange(len(h))
    h[index[dead], index[dead]] = 1.0
    h[index, index] += np.float32(percdamp) * np.mean(diag, dtype=np.float32)
    lower, info = lapack.spotrf(h, lower=1, clean=1)
    if info == 0:
        inverse, info = lapack.spotri(lower, lower=1)
    if info != 0:
        raise ValueError(
            "the Hessian is not positive definite even after dampening: raise the dampening "
            "(--gptq-dampening) or calibrate on more tokens"
        )
    inverse = np.tril(inverse) + np.tril(inverse, -1).T
    upper, info = lapack.spotrf(inverse, lower=0, clean=1)
    if info != 0:
        raise ValueError("the inverse Hessian is not positive definite: raise the dampening")
    return upper, dead


@jax.jit(static_argnames=("groupsize", "how"))
def _static_scales(w, *, groupsize, how):
    return gptq_core._static_scales(w.astype(jnp.float32), groupsize, how, w.dtype)


# Columns whose error is pushed onto each other one by one inside a block; onto the rest of the
# block it goes as one matrix product per sub-block (GPTQ's lazy batch, one level down): the
# one-by-one updates then touch SUB rows of W instead of up to blocksize, ~3x less memory
# traffic for a 128-column block.
_SUB = 16


def _loop(wt, hinv, st, zt, limits, options):
    """The column loop on W transposed (columns, rows): column i is the contiguous row wt[i]."""
    lo, hi = limits
    columns = wt.shape[0]
    codes = np.empty_like(wt)
    losses = np.empty_like(wt)
    for start in range(0, columns, options.blocksize):
        stop = min(start + options.blocksize, columns)
        block = wt[start:stop]  # a view: updated in place
        h = hinv[start:stop, start:stop]
        err = np.empty_like(block)
        width = stop - start
        for sub in range(0, width, _SUB):
            end = min(sub + _SUB, width)
            for i in range(sub, end):
                c = start + i
                w = block[i]
                y = w / st[c] if zt is None else w / st[c] + zt[c]
                q = np.clip(np.rint(y), lo, hi)
                dq = (q if zt is None else q - zt[c]) * st[c]
                e = (w - dq) / h[i, i]
                block[i + 1 : end] -= np.outer(h[i, i + 1 : end], e)
                err[i] = e
                codes[c] = q
                losses[c] = np.square(w - dq) / (2 * h[i, i] * h[i, i])
            if end < width:
                block[end:] -= h[sub:end, end:].T @ err[sub:end]
        if stop < columns:
            wt[stop:] -= hinv[start:stop, stop:].T @ err
    return codes, losses
