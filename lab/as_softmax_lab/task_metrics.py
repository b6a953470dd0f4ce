"""The tasks' metrics (accuracy, micro-F1, entity F1) and margins, in numpy."""

import numpy as np

from as_softmax_lab.methods import IGNORE_CLASS
from as_softmax_lab.methods import check_task


def bio_spans(tags):
    """Entity spans of one BIO tag sequence, seqeval-style (non-strict).

    A span starts at a `B-X`, or at an `I-X` that does not continue a span
    of type `X`; it ends before an `O`, a `B-`, or a tag of another type.
    Tags without a `B-`/`I-` prefix other than `O` are single-type chunks.

    Args:
        tags: sequence of tag strings such as `["B-PER", "I-PER", "O"]`.

    Returns:
        A set of `(type, start, end)` with `end` exclusive.

    Example:

    >>> sorted(bio_spans(["B-PER", "I-PER", "O", "I-LOC", "B-LOC"]))
    [('LOC', 3, 4), ('LOC', 4, 5), ('PER', 0, 2)]
    """
    spans = set()
    current, start = None, None
    for i, tag in enumerate(list(tags) + ["O"]):
        if tag == "O" or tag is None:
            prefix, kind = "O", None
        elif tag[:2] in ("B-", "I-"):
            prefix, kind = tag[0], tag[2:]
        else:
            prefix, kind = "I", tag
        continues = prefix == "I" and kind == current
        if current is not None and not continues:
            spans.add((current, start, i))
            current = None
        if prefix != "O" and not continues:
            current, start = kind, i
    return spans


def bio_f1_score(true_tags, pred_tags):
    """Entity-level micro F1 of BIO tag sequences (as `seqeval`'s default).

    Args:
        true_tags: list of tag-string sequences.
        pred_tags: list of tag-string sequences of the same lengths.

    Returns:
        float F1 in [0, 1] (0 when there are no true and no predicted spans).

    Example:

    >>> bio_f1_score([["B-PER", "I-PER", "O"]], [["B-PER", "O", "O"]])
    0.0
    """
    n_true = n_pred = n_correct = 0
    for t, p in zip(true_tags, pred_tags, strict=True):
        ts, ps = bio_spans(t), bio_spans(p)
        n_true += len(ts)
        n_pred += len(ps)
        n_correct += len(ts & ps)
    if n_correct == 0:
        return 0.0
    precision, recall = n_correct / n_pred, n_correct / n_true
    return 2 * precision * recall / (precision + recall)


def micro_f1(y_true, logits):
    """Multi-label micro F1, predicting a class where its logit is > 0."""
    pred = np.asarray(logits) > 0
    true = np.asarray(y_true) > 0.5
    tp = np.sum(pred & true)
    denom = np.sum(pred) + np.sum(true)
    return float(2 * tp / denom) if denom else 0.0


def task_metric(task, y_true, logits, class_names=None):
    """The task's validation metric from labels and logits (numpy).

    Accuracy for `"multiclass"`, micro-F1 for `"multilabel"`, entity F1 over
    first word pieces for `"tokens"` (needs `class_names`).
    """
    check_task(task)
    logits = np.asarray(logits)
    if task == "multiclass":
        return float(np.mean(np.argmax(logits, -1) == np.asarray(y_true)))
    if task == "multilabel":
        return micro_f1(y_true, logits)
    pred = np.argmax(logits, -1)
    true_seqs, pred_seqs = [], []
    for t_row, p_row in zip(np.asarray(y_true), pred, strict=True):
        keep = t_row != IGNORE_CLASS
        true_seqs.append([class_names[i] for i in t_row[keep]])
        pred_seqs.append([class_names[i] for i in p_row[keep]])
    return bio_f1_score(true_seqs, pred_seqs)


def probability_margins(task, y_true, logits):
    """`p_target - max p_other` per sample (paper Fig. 4), softmax probs.

    For tokens, one value per non-ignored token; for multi-label, the
    weakest positive's probability minus the strongest negative's.
    """
    logits = np.asarray(logits, "float64")
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    if task == "multilabel":
        pos = np.asarray(y_true) > 0.5
        has_both = pos.any(-1) & (~pos).any(-1)
        p_pos = np.where(pos, probs, np.inf).min(-1)
        p_neg = np.where(pos, -np.inf, probs).max(-1)
        return (p_pos - p_neg)[has_both]
    y = np.asarray(y_true).reshape(-1)
    probs = probs.reshape(-1, probs.shape[-1])
    keep = y != IGNORE_CLASS
    y, probs = y[keep], probs[keep]
    target = probs[np.arange(len(y)), y]
    other = probs.copy()
    other[np.arange(len(y)), y] = -np.inf
    return target - other.max(-1)
