"""Plain NumPy float64 references, written from the formulas, loop by loop."""

import numpy as np


def _lse(x):
    m = np.max(x)
    return m + np.log(np.sum(np.exp(x - m)))


def _softmax(o):
    e = np.exp(o - o.max())
    return e / e.sum()


def _rows(labels, logits, ignore_class, row_fn):
    labels = np.asarray(labels)
    logits = np.asarray(logits, dtype=np.float64)
    out = np.zeros(labels.shape)
    for idx in np.ndindex(labels.shape):
        t = int(labels[idx])
        if ignore_class is not None and t == ignore_class:
            continue
        out[idx] = row_fn(logits[idx], t)
    return out


def as_softmax(labels, logits, delta, ignore_class=None):
    def row(o, t):
        p = _softmax(o)
        keep = (p[t] - p) < delta
        keep[t] = True
        return _lse(o[keep]) - o[t]

    return _rows(labels, logits, ignore_class, row)


def as_softmax_grad(labels, logits, delta):
    """Analytic gradient: softmax over kept classes minus one-hot."""
    logits = np.asarray(logits, dtype=np.float64)
    grad = np.zeros_like(logits)
    for idx in np.ndindex(np.asarray(labels).shape):
        o, t = logits[idx], int(labels[idx])
        p = _softmax(o)
        keep = (p[t] - p) < delta
        keep[t] = True
        q = np.where(keep, np.exp(o - o[keep].max()), 0.0)
        g = q / q.sum()
        g[t] -= 1.0
        grad[idx] = g
    return grad


def sparse_softmax(labels, logits, k, ignore_class=None):
    def row(o, t):
        keep = np.zeros(o.shape, bool)
        keep[np.argsort(-o, kind="stable")[:k]] = True
        keep[t] = True
        return _lse(o[keep]) - o[t]

    return _rows(labels, logits, ignore_class, row)


def am_softmax(labels, logits, scale, margin, ignore_class=None):
    def row(o, t):
        z = scale * o.copy()
        z[t] = scale * (o[t] - margin)
        return _lse(z) - z[t]

    return _rows(labels, logits, ignore_class, row)


def temperature_softmax(labels, logits, temperature, ignore_class=None):
    return _rows(
        labels,
        logits,
        ignore_class,
        lambda o, t: _lse(o / temperature) - o[t] / temperature,
    )


def _bisect_tau(f, lo, hi):
    for _ in range(200):
        mid = (lo + hi) / 2
        if f(mid) > 1.0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def sparsemax_probs(o):
    tau = _bisect_tau(
        lambda tau: np.maximum(o - tau, 0).sum(), o.min() - 1, o.max()
    )
    return np.maximum(o - tau, 0)


def entmax15_probs(o):
    z = o / 2
    tau = _bisect_tau(
        lambda tau: (np.maximum(z - tau, 0) ** 2).sum(), z.min() - 1, z.max()
    )
    return np.maximum(z - tau, 0) ** 2


def sparsemax_loss(labels, logits, ignore_class=None):
    def row(o, t):
        p = sparsemax_probs(o)
        support = p > 0
        tau = (o[support].sum() - 1) / support.sum()
        return -o[t] + 0.5 * np.sum(o[support] ** 2 - tau**2) + 0.5

    return _rows(labels, logits, ignore_class, row)


def entmax15_loss(labels, logits, ignore_class=None):
    def row(o, t):
        p = entmax15_probs(o)
        onehot = np.eye(len(o))[t]
        return (1 - np.sum(p**1.5)) / 0.75 + np.dot(p - onehot, o)

    return _rows(labels, logits, ignore_class, row)


def multilabel(y, logits, delta=None):
    y = np.asarray(y) > 0.5
    logits = np.asarray(logits, dtype=np.float64)
    out = np.zeros(y.shape[:-1])
    for idx in np.ndindex(out.shape):
        o, pos = logits[idx], y[idx]
        neg = ~pos
        z_neg, z_pos = neg.copy(), pos.copy()
        if delta is not None:
            p = _softmax(o)
            if pos.any():
                z_neg &= ~(p[pos].min() - p >= delta)
            if neg.any():
                z_pos &= ~(p - p[neg].max() >= delta)
        out[idx] = _lse(np.append(o[z_neg], 0.0)) + _lse(
            np.append(-o[z_pos], 0.0)
        )
    return out
