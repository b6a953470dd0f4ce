"""A reusable experiment runner: softmax vs AS-Softmax vs AS-Speed.

Used by `examples/demo.py`, `benchmarks/as_speed.py` and the example
notebooks. One run fine-tunes a KerasHub BERT backbone (by default the
offline all-MiniLM-L6-v2) on one of three task types:

* `"multiclass"`: a `ClassificationData` with integer labels (accuracy);
* `"multilabel"`: a `ClassificationData` with multi-hot labels (micro-F1,
  a class is predicted where its logit is > 0);
* `"tokens"`: a `TokenClassificationData` of BIO tags (entity-level F1,
  seqeval-style, see `bio_f1_score`).

Texts are tokenized once, up front, into numpy arrays (`prepare_data`), and
`run` feeds them as a seeded, shuffled `tf.data` pipeline, so that timings
measure the model and not the tokenizer. Each run records the masked ratio
of every training batch (paper Fig. 1; for softmax the ratio an
`ASSoftmaxLoss(delta)` *would* mask on the same batches), periodic
validation loss and metric (paper Table 4), training wall-clock per epoch
(XLA compilation excluded and reported separately), and the test set's
probability margins `p_target - max p_other` (paper Fig. 4).

Example:

```python
from keras_as_softmax import datasets, experiments

backbone = experiments.load_backbone("offline-minilm")
data = datasets.load_text_classification("wordnet", max_examples=500)
prepared = experiments.prepare_data(data, backbone.tokenizer, 32)
results = [
    experiments.run(method, prepared, backbone, seed=0, epochs=2)
    for method in experiments.METHODS
]
print(experiments.compare(results))
experiments.plot_masked_ratio(results, "masked_ratio.png")
```
"""

import dataclasses
import math
import time

import keras
import numpy as np
from keras import ops

from keras_as_softmax.as_speed import ASSpeed
from keras_as_softmax.callbacks import DeltaWarmup
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelCategoricalCrossentropy
from keras_as_softmax.metrics import MaskedRatio
from keras_as_softmax.sample_skipping import MaskedSampleSkipper

TASKS = ("multiclass", "multilabel", "tokens")
IGNORE_CLASS = -1
DEFAULT_DELTA = {"multiclass": 0.3, "multilabel": 0.05, "tokens": 0.3}
METRIC_NAMES = {"multiclass": "accuracy", "multilabel": "micro_f1", "tokens": "entity_f1"}


# ----------------------------------------------------------------- methods


@dataclasses.dataclass(frozen=True)
class Method:
    """A training method compared by the runner.

    Attributes:
        name: a `METHODS` key.
        as_loss: whether it trains with the AS-Softmax loss.
        as_speed: whether the model is wrapped in `ASSpeed`.
        description: one line for tables.
        skip_masked: `ASSpeed(skip_masked=True)`: once half of a batch is
            masked, score each batch first and train only on the samples
            not masked now (beyond the paper).
        skip_stale: whether each step leaves out the samples that were
            masked when last seen (`MaskedSampleSkipper`; beyond the paper).
    """

    name: str
    as_loss: bool
    as_speed: bool
    description: str
    skip_masked: bool = False
    skip_stale: bool = False


METHODS = {
    "softmax": Method("softmax", False, False, "softmax cross entropy"),
    "as_softmax": Method("as_softmax", True, False, "AS-Softmax loss"),
    "as_speed": Method("as_speed", True, True, "AS-Softmax + adaptive accumulation"),
    "as_skip": Method(
        "as_skip", True, True, "AS-Speed + training passes only on samples not masked now",
        skip_masked=True,
    ),
    "as_skip_stale": Method(
        "as_skip_stale", True, True, "AS-Speed + skipping samples masked when last seen",
        skip_stale=True,
    ),
    "as_skip_hybrid": Method(
        "as_skip_hybrid", True, True,
        "as_skip on the samples not masked when last seen (plus a revisited fraction)",
        skip_masked=True, skip_stale=True,
    ),
}


def make_loss(method, task, delta=None):
    """The training loss of `method` for `task`.

    Args:
        method: a `METHODS` key or `Method`.
        task: one of `TASKS`.
        delta: the AS-Softmax margin. Defaults to `DEFAULT_DELTA[task]`.

    Returns:
        A `keras.losses.Loss`: `SparseCategoricalCrossentropy(from_logits=True)`
        (with `ignore_class=-1` for tokens) or `MultiLabelCategoricalCrossentropy`
        for softmax, `ASSoftmaxLoss(delta)` / `MultiLabelASSoftmaxLoss(delta)`
        for the AS methods.
    """
    method = _method(method)
    _check_task(task)
    delta = DEFAULT_DELTA[task] if delta is None else delta
    ignore = IGNORE_CLASS if task == "tokens" else None
    if task == "multilabel":
        return MultiLabelASSoftmaxLoss(delta) if method.as_loss else MultiLabelCategoricalCrossentropy()
    if method.as_loss:
        return ASSoftmaxLoss(delta, ignore_class=ignore)
    return keras.losses.SparseCategoricalCrossentropy(from_logits=True, ignore_class=ignore)


def _method(method):
    if isinstance(method, Method):
        return method
    if method not in METHODS:
        raise ValueError(f"Expected `method` in {tuple(METHODS)}. Received: method={method!r}")
    return METHODS[method]


def _check_task(task):
    if task not in TASKS:
        raise ValueError(f"Expected `task` in {TASKS}. Received: task={task!r}")


# ------------------------------------------------------------ the backbone


class Backbone:
    """A BERT backbone loaded once, cloned fresh for every run.

    Attributes:
        backbone: the loaded `keras_hub.models.BertBackbone`.
        tokenizer: its `keras_hub.models.BertTokenizer`.
        preset: the preset it came from (or `None`).

    Use `load_backbone(preset)` for a pretrained one, or wrap any backbone
    and tokenizer (e.g. a tiny randomly initialised one in tests).
    """

    def __init__(self, backbone, tokenizer, preset=None):
        self.backbone = backbone
        self.tokenizer = tokenizer
        self.preset = preset
        self._config = backbone.get_config()
        self._weights = backbone.get_weights()

    def fresh(self):
        """A new backbone with the loaded (initial) weights."""
        import keras_hub

        backbone = keras_hub.models.BertBackbone.from_config(self._config)
        backbone.set_weights(self._weights)
        return backbone


def load_backbone(preset="offline-minilm", **kwargs):
    """Loads a pretrained BERT backbone and tokenizer as a `Backbone`.

    Args:
        preset: `"offline-minilm"` (default, no network) or any KerasHub
            BERT preset; see `keras_as_softmax.backbones.load_bert`.
        **kwargs: passed to `load_bert`.

    Returns:
        A `Backbone`.
    """
    from keras_as_softmax.backbones import load_bert

    backbone, tokenizer = load_bert(preset, **kwargs)
    return Backbone(backbone, tokenizer, preset)


def build_classifier(task, num_classes, backbone="offline-minilm", dropout=0.1, pooling="mean"):
    """Builds a classifier returning logits on a KerasHub BERT backbone.

    Inputs are the dict `{"token_ids", "padding_mask", "segment_ids"}` of
    `(batch, sequence_length)` arrays. For `"multiclass"`/`"multilabel"`
    the sentence vector (`pooling`) goes through dropout and a
    `Dense(num_classes)`; for `"tokens"` every position of the sequence
    output does, giving `(batch, sequence_length, num_classes)` logits.

    Args:
        task: one of `TASKS`.
        num_classes: number of classes (or tags).
        backbone: a `Backbone` (a fresh copy is used), a
            `keras_hub.models.BertBackbone` (used as is), or a preset string.
        dropout: dropout rate before the output layer. Defaults to `0.1`.
        pooling: sentence vector for the sentence tasks: `"mean"` (masked
            mean of the sequence output, what all-MiniLM-L6-v2 was trained
            with; default), `"cls"` (the `[CLS]` position) or `"pooled"`
            (the backbone's `pooled_output`).

    Returns:
        A functional `keras.Model` returning logits.
    """
    _check_task(task)
    if isinstance(backbone, str):
        backbone = load_backbone(backbone)
    if isinstance(backbone, Backbone):
        backbone = backbone.fresh()
    names = ("token_ids", "padding_mask", "segment_ids")
    inputs = {n: keras.Input(shape=(None,), dtype="int32", name=n) for n in names}
    outputs = backbone(inputs)
    if task == "tokens":
        x = outputs["sequence_output"]
    elif pooling == "mean":
        mask = ops.expand_dims(ops.cast(inputs["padding_mask"], outputs["sequence_output"].dtype), -1)
        x = ops.sum(outputs["sequence_output"] * mask, axis=1) / ops.maximum(ops.sum(mask, axis=1), 1.0)
    elif pooling == "cls":
        x = outputs["sequence_output"][:, 0, :]
    elif pooling == "pooled":
        x = outputs["pooled_output"]
    else:
        raise ValueError(f"Expected `pooling` in ('mean', 'cls', 'pooled'). Received: {pooling!r}")
    x = keras.layers.Dropout(dropout)(x)
    logits = keras.layers.Dense(num_classes, dtype="float32", name="logits")(x)
    return keras.Model(inputs, logits, name=f"bert_{task}_classifier")


# ------------------------------------------------------------------- data


@dataclasses.dataclass
class PreparedData:
    """A dataset tokenized once into numpy arrays.

    Attributes:
        name: dataset name.
        task: one of `TASKS`.
        class_names: tuple of class (or tag) names.
        train, validation, test: `(x, y)` with `x` a dict of int32 arrays
            `(n, sequence_length)` and `y` the labels: int32 `(n,)`,
            float32 multi-hot `(n, C)`, or int32 `(n, sequence_length)` tags
            with `-1` on non-first word pieces, special tokens and padding.
    """

    name: str
    task: str
    class_names: tuple
    train: tuple
    validation: tuple
    test: tuple

    @property
    def num_classes(self):
        return len(self.class_names)

    @property
    def metric_name(self):
        return METRIC_NAMES[self.task]

    def __repr__(self):
        sizes = ", ".join(f"{s}={len(getattr(self, s)[1])}" for s in ("train", "validation", "test"))
        return f"PreparedData(name={self.name!r}, task={self.task!r}, num_classes={self.num_classes}, {sizes})"


def tokenize_texts(tokenizer, texts, sequence_length, batch_size=1024):
    """Tokenizes sentences into `[CLS] ... [SEP]` padded numpy arrays.

    Returns:
        dict of int32 arrays `token_ids`, `padding_mask`, `segment_ids`,
        each `(len(texts), sequence_length)`.
    """
    from keras_as_softmax.backbones import text_classifier_preprocessor

    preprocessor = text_classifier_preprocessor(tokenizer, sequence_length)
    parts = []
    for start in range(0, len(texts), batch_size):
        out = preprocessor(list(texts[start : start + batch_size]))
        parts.append({k: np.asarray(ops.convert_to_numpy(v)).astype("int32") for k, v in out.items()})
    if not parts:
        return {k: np.zeros((0, sequence_length), "int32") for k in ("token_ids", "padding_mask", "segment_ids")}
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


def tokenize_tagged(tokenizer, sentences, tags, sequence_length, ignore_class=IGNORE_CLASS):
    """Tokenizes word-tagged sentences, aligning tags to word pieces.

    Every word is split into word pieces; its first piece gets the word's
    tag, its other pieces, `[CLS]`, `[SEP]` and padding get `ignore_class`.
    Sentences longer than `sequence_length - 2` pieces are truncated (their
    last words are dropped from training and evaluation alike).

    Returns:
        `(x, y)`: dict of int32 arrays `(n, sequence_length)` and int32 tags
        `(n, sequence_length)`.
    """
    words = [w for sentence in sentences for w in sentence]
    pieces = tokenizer(words) if words else []
    pieces = [list(np.asarray(ops.convert_to_numpy(p)).reshape(-1)) for p in pieces] if words else []
    cls_id, sep_id = tokenizer.cls_token_id, tokenizer.sep_token_id
    pad_id = tokenizer.pad_token_id
    n = len(sentences)
    token_ids = np.full((n, sequence_length), pad_id, "int32")
    padding_mask = np.zeros((n, sequence_length), "int32")
    labels = np.full((n, sequence_length), ignore_class, "int32")
    k = 0
    for i, (sentence, sentence_tags) in enumerate(zip(sentences, tags)):
        ids, lab = [cls_id], [ignore_class]
        for tag in sentence_tags:
            word_pieces = pieces[k] or [tokenizer.unk_token_id]
            k += 1
            if len(ids) + len(word_pieces) > sequence_length - 1:
                continue
            ids.extend(int(p) for p in word_pieces)
            lab.extend([int(tag)] + [ignore_class] * (len(word_pieces) - 1))
        ids.append(sep_id)
        lab.append(ignore_class)
        token_ids[i, : len(ids)] = ids
        padding_mask[i, : len(ids)] = 1
        labels[i, : len(lab)] = lab
    x = {"token_ids": token_ids, "padding_mask": padding_mask, "segment_ids": np.zeros_like(token_ids)}
    return x, labels


def prepare_data(data, tokenizer, sequence_length=64):
    """Tokenizes a dataset from `keras_as_softmax.datasets` once.

    Args:
        data: a `ClassificationData` (multi-class or multi-label) or a
            `TokenClassificationData`.
        tokenizer: a `keras_hub.models.BertTokenizer` (e.g.
            `Backbone.tokenizer`).
        sequence_length: padded length, `[CLS]`/`[SEP]` included.

    Returns:
        A `PreparedData`.
    """
    from keras_as_softmax.datasets import TokenClassificationData

    splits = {}
    if isinstance(data, TokenClassificationData):
        task = "tokens"
        for name, split in data.splits.items():
            splits[name] = tokenize_tagged(tokenizer, split.tokens, split.tags, sequence_length)
    else:
        task = "multilabel" if data.multi_label else "multiclass"
        for name, split in data.splits.items():
            labels = np.asarray(split.labels, "float32" if data.multi_label else "int32")
            splits[name] = (tokenize_texts(tokenizer, split.texts, sequence_length), labels)
    return PreparedData(data.name, task, tuple(data.class_names), **splits)


def _subset(split, n):
    x, y = split
    return {k: v[:n] for k, v in x.items()}, y[:n]


def make_dataset(split, batch_size, shuffle_seed=None, drop_remainder=False):
    """A `tf.data.Dataset` of `(x, y)` batches; shuffled when a seed is given."""
    import tensorflow as tf

    x, y = split
    ds = tf.data.Dataset.from_tensor_slices((x, y))
    if shuffle_seed is not None:
        ds = ds.shuffle(len(y), seed=shuffle_seed, reshuffle_each_iteration=True)
    return ds.batch(batch_size, drop_remainder=drop_remainder).prefetch(tf.data.AUTOTUNE)


# ---------------------------------------------------------------- metrics


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
    for t, p in zip(true_tags, pred_tags):
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
    _check_task(task)
    logits = np.asarray(logits)
    if task == "multiclass":
        return float(np.mean(np.argmax(logits, -1) == np.asarray(y_true)))
    if task == "multilabel":
        return micro_f1(y_true, logits)
    pred = np.argmax(logits, -1)
    true_seqs, pred_seqs = [], []
    for t_row, p_row in zip(np.asarray(y_true), pred):
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


# --------------------------------------------------------------- callbacks


class _Recorder(keras.callbacks.Callback):
    """Per-batch masked ratio and timing, periodic validation."""

    def __init__(self, tracker, evaluate, eval_every):
        super().__init__()
        self.tracker = tracker
        self.evaluate = evaluate
        self.eval_every = eval_every
        self.step = 0
        self.masked_ratio, self.accum_steps = [], []
        self.evals, self.epoch_times, self.epoch_batches = [], [], []
        self.backward_fraction = []
        self.step_times = []  # (epoch, batch, seconds), the first step left out
        self.compile_time = 0.0
        self.train_time = 0.0  # cumulative, compile and evaluation excluded
        self._prev = (0.0, 0.0)

    def on_epoch_begin(self, epoch, logs=None):
        self.epoch_batches.append(0)
        self._prev = (0.0, 0.0)
        self._epoch_time = 0.0
        self._t = time.perf_counter()

    def on_train_batch_end(self, batch, logs=None):
        masked = float(ops.convert_to_numpy(self.tracker.masked))
        counted = float(ops.convert_to_numpy(self.tracker.counted))
        now = time.perf_counter()
        elapsed = now - self._t
        if self.step == 0:
            self.compile_time = elapsed
        else:
            self._epoch_time += elapsed
            self.train_time += elapsed
            self.step_times.append((len(self.epoch_batches), batch, elapsed))
        self.step += 1
        self.epoch_batches[-1] += 1
        dm, dc = masked - self._prev[0], counted - self._prev[1]
        self._prev = (masked, counted)
        self.masked_ratio.append(dm / dc if dc > 0 else float("nan"))
        if isinstance(self.model, ASSpeed):
            self.accum_steps.append(self.model.accumulation_steps)
        if self.eval_every and self.step % self.eval_every == 0:
            self._evaluate(None)
        self._t = time.perf_counter()

    def on_epoch_end(self, epoch, logs=None):
        self.epoch_times.append(self._epoch_time)
        if logs and "backward_fraction" in logs:
            self.backward_fraction.append(float(logs["backward_fraction"]))
        if not self.evals or self.evals[-1]["step"] != self.step:
            self._evaluate(epoch)
        if self.evals[-1]["epoch"] is None:
            self.evals[-1]["epoch"] = epoch

    def _evaluate(self, epoch):
        loss, metric = self.evaluate(self.model)
        self.evals.append(
            {"step": self.step, "epoch": epoch, "time": self.train_time, "val_loss": loss, "val_metric": metric}
        )


# -------------------------------------------------------------------- run


@dataclasses.dataclass
class RunResult:
    """What one `run` measured.

    Attributes:
        method, seed, task, metric_name, dataset: identify the run.
        epochs: number of epochs trained.
        steps_per_epoch: training batches per epoch.
        optimizer_updates: optimizer steps taken (fewer than batches under
            AS-Speed).
        compile_time: seconds of the first batch (tracing + XLA compile).
        epoch_times: training seconds per epoch, compile and validation
            excluded.
        batches_per_epoch: training batches run in each epoch (the skipping
            methods drop samples inside a batch, not batches).
        masked_ratio: per training batch, the fraction of counted rows whose
            AS-Softmax loss is exactly 0 (for softmax: that an
            `ASSoftmaxLoss(delta)` would mask).
        accum_steps: per batch, `ASSpeed.accumulation_steps` (AS-Speed only).
        evals: list of dicts `step`, `epoch`, `time` (cumulative training
            seconds), `val_loss` (the method's own loss), `val_metric`.
        val_metric, val_loss: at the end of training.
        test_metric, test_loss: at the end of training.
        test_margins: `probability_margins` on the test set.
        backward_fraction: per epoch, the share of drawn samples that went
            through the training passes (the `"as_skip*"` methods).
        step_times: `(epoch, batch, seconds)` of every training step but
            the first (epochs counted from 1).
        model: the trained model (not printed).
    """

    method: str
    seed: int
    task: str
    metric_name: str
    dataset: str
    epochs: int
    steps_per_epoch: int
    optimizer_updates: int
    compile_time: float
    epoch_times: list
    batches_per_epoch: list
    masked_ratio: list
    accum_steps: list
    evals: list
    val_metric: float
    val_loss: float
    test_metric: float
    test_loss: float
    test_margins: np.ndarray = dataclasses.field(repr=False)
    backward_fraction: list = dataclasses.field(default_factory=list)
    step_times: list = dataclasses.field(default_factory=list, repr=False)
    model: object = dataclasses.field(default=None, repr=False)

    @property
    def train_time(self):
        """Total training seconds (compile and validation excluded)."""
        return float(sum(self.epoch_times))

    @property
    def time_per_epoch(self):
        return self.train_time / max(self.epochs, 1)

    @property
    def best_val_metric(self):
        return max(e["val_metric"] for e in self.evals)

    def time_to_reach(self, target):
        """Training seconds until a validation metric >= `target`, or `None`."""
        for e in self.evals:
            if e["val_metric"] >= target - 1e-12:
                return e["time"]
        return None


def _predict(model, x, batch_size):
    return model.predict(x, batch_size=batch_size, verbose=0)


def _loss_value(loss, y, logits):
    return float(ops.convert_to_numpy(loss(ops.convert_to_tensor(y), ops.convert_to_tensor(logits))))


def run(
    method,
    data,
    backbone,
    seed=0,
    epochs=2,
    batch_size=32,
    learning_rate=1e-4,
    weight_decay=0.01,
    delta=None,
    lam=0.5,
    max_steps=5,
    revisit=0.2,
    warmup_ratio=0.0,
    evals_per_epoch=1,
    eval_batch_size=128,
    jit_compile=None,
    verbose=1,
    keep_model=False,
):
    """Fine-tunes one model with one method and measures it.

    Args:
        method: a `METHODS` key, e.g. `"softmax"`, `"as_softmax"`, `"as_speed"`.
        data: a `PreparedData` (see `prepare_data`).
        backbone: a `Backbone` (each run starts from its initial weights).
        seed: seeds the head's initialisation, dropout and shuffling.
        epochs: training epochs (passes over `data.train`).
        batch_size: micro-batch size (AS-Speed accumulates several).
        learning_rate: AdamW's learning rate. Defaults to `1e-4`.
        weight_decay: AdamW's weight decay. Defaults to `0.01`.
        delta: AS-Softmax margin; defaults to `DEFAULT_DELTA[task]`. Also
            the margin of the masked ratio recorded for softmax.
        lam, max_steps: AS-Speed's lambda and cap `s` (Clinc: 0.5 / 5).
        revisit: for `"as_skip_stale"` and `"as_skip_hybrid"`, the
            probability that a sample masked at its last visit is trained
            on anyway. Defaults to `0.2`.
        warmup_ratio: if > 0, the AS methods train with `delta = 1` for
            this fraction of steps (`DeltaWarmup`).
        evals_per_epoch: validation passes per epoch (more points for the
            loss-vs-metric correlation). Defaults to `1`.
        eval_batch_size: batch size of validation/test prediction.
        jit_compile: defaults to `True` on TensorFlow (`False` for the
            `"as_skip*"` methods, which gather the samples to train on into
            a batch of their own size, a graph-only shape; see `ASSpeed`),
            `"auto"` otherwise.
        verbose: 1 shows Keras's progress bar, 0 nothing.
        keep_model: keep the trained model in the result.

    Returns:
        A `RunResult`.
    """
    method = _method(method)
    task = data.task
    delta = DEFAULT_DELTA[task] if delta is None else delta
    if jit_compile is None:
        skips = method.skip_masked or method.skip_stale
        jit_compile = (not skips) if keras.backend.backend() == "tensorflow" else "auto"
    keras.utils.set_random_seed(seed)
    model = build_classifier(task, data.num_classes, backbone)
    loss = make_loss(method, task, delta)
    optimizer = keras.optimizers.AdamW(learning_rate=learning_rate, weight_decay=weight_decay)
    metrics = []
    skipper = None
    if method.skip_stale:
        skipper = MaskedSampleSkipper(len(data.train[1]), revisit=revisit, seed=seed)
    if method.as_speed:
        model = ASSpeed(
            model, lam=lam, max_steps=max_steps, sample_skipper=skipper, skip_masked=method.skip_masked
        )
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
        tracker = model.masked_ratio_tracker
    else:
        if method.as_loss:
            tracker = MaskedRatio(loss)
        elif task == "multilabel":
            tracker = MaskedRatio(MultiLabelASSoftmaxLoss(delta))
        else:
            tracker = MaskedRatio(ASSoftmaxLoss(delta, ignore_class=IGNORE_CLASS if task == "tokens" else None))
        metrics = [tracker]
        model.compile(optimizer=optimizer, loss=loss, metrics=metrics, jit_compile=jit_compile)

    x_val, y_val = data.validation

    def evaluate(m):
        logits = _predict(m, x_val, eval_batch_size)
        return _loss_value(loss, y_val, logits), task_metric(task, y_val, logits, data.class_names)

    n_train = len(data.train[1])
    steps_per_epoch = n_train // batch_size
    if steps_per_epoch < 1:
        raise ValueError(f"Need at least batch_size={batch_size} training examples. Received: {n_train}")
    eval_every = max(1, steps_per_epoch // evals_per_epoch) if evals_per_epoch > 1 else 0
    recorder = _Recorder(tracker, evaluate, eval_every)
    callbacks = [recorder]
    if warmup_ratio > 0 and method.as_loss:
        callbacks.append(DeltaWarmup(warmup_ratio=warmup_ratio))
    # One iterator for the whole fit (reshuffled every pass): a new
    # iterator per epoch stalled the first step of an epoch by up to tens
    # of seconds here, in every method alike.
    if skipper is not None:
        train_ds = skipper.dataset(*data.train, batch_size=batch_size, seed=seed)
    else:
        train_ds = make_dataset(data.train, batch_size, shuffle_seed=seed, drop_remainder=True)
    model.fit(
        train_ds.repeat(), epochs=epochs, steps_per_epoch=steps_per_epoch, callbacks=callbacks,
        verbose=verbose, shuffle=False,
    )

    x_test, y_test = data.test
    test_logits = _predict(model, x_test, eval_batch_size)
    final = recorder.evals[-1]
    return RunResult(
        method=method.name,
        seed=seed,
        task=task,
        metric_name=data.metric_name,
        dataset=data.name,
        epochs=epochs,
        steps_per_epoch=steps_per_epoch,
        optimizer_updates=int(ops.convert_to_numpy(model.optimizer.iterations)),
        compile_time=recorder.compile_time,
        epoch_times=recorder.epoch_times,
        batches_per_epoch=recorder.epoch_batches,
        masked_ratio=recorder.masked_ratio,
        accum_steps=recorder.accum_steps,
        evals=recorder.evals,
        val_metric=final["val_metric"],
        val_loss=final["val_loss"],
        test_metric=task_metric(task, y_test, test_logits, data.class_names),
        test_loss=_loss_value(loss, y_test, test_logits),
        test_margins=probability_margins(task, y_test, test_logits),
        backward_fraction=recorder.backward_fraction,
        step_times=recorder.step_times,
        model=model if keep_model else None,
    )


# --------------------------------------------------------------- reporting


def _fmt_stats(values, scale=100.0, digits=2):
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    if not values:
        return "n/a"
    values = np.asarray(values, "float64") * scale
    if len(values) == 1:
        return f"{values[0]:.{digits}f}"
    return f"{values.mean():.{digits}f} ± {values.std(ddof=1):.{digits}f}"


def _table(header, rows):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]
    line = lambda r: "  ".join(str(c).rjust(w) if i else str(c).ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    sep = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), sep] + [line(r) for r in rows])


def compare(results, baseline="softmax"):
    """A plain-text table comparing runs, grouped by method.

    Per method (mean ± std over seeds where there are several): final
    validation and test metric (in %), best validation metric, training
    seconds per epoch (compile excluded), optimizer updates, the training
    seconds until the run first reached the *baseline's best* validation
    metric of the same seed (`-` if never), the time ratio of that to the
    baseline's, the epoch-time ratio (all epochs, then the last epoch
    alone: where masking has set in), the mean masked ratio over the last
    epoch, the share of the last epoch's samples that went through the
    training forward and backward passes, and the Pearson correlation of validation loss and metric.

    Args:
        results: list of `RunResult`.
        baseline: the method the others are compared with.

    Returns:
        str.
    """
    by_method = {}
    for r in results:
        by_method.setdefault(r.method, []).append(r)
    base = {r.seed: r for r in by_method.get(baseline, [])}
    metric = results[0].metric_name if results else "metric"
    header = [
        "method", "seeds", f"val {metric}", f"test {metric}", f"best val", "s/epoch",
        "updates", "t->base best", "t ratio", "epoch ratio", "last-ep ratio", "masked(last ep)", "trained(last ep)",
        "pearson(loss,metric)",
    ]
    rows = []
    base_epoch = np.mean([r.time_per_epoch for r in base.values()]) if base else None
    base_last = np.mean([r.epoch_times[-1] for r in base.values()]) if base else None
    for name, runs in by_method.items():
        reach, ratios = [], []
        for r in runs:
            if r.seed in base:
                target = base[r.seed].best_val_metric
                t = r.time_to_reach(target)
                tb = base[r.seed].time_to_reach(target)
                reach.append(t)
                ratios.append(t / tb if t is not None and tb else None)
        masked = [float(np.nanmean(r.masked_ratio[-r.batches_per_epoch[-1]:])) for r in runs]
        pearson = [loss_metric_correlation(r) for r in runs]
        # Share of the epoch's samples that went through the training passes.
        trained = [
            (r.backward_fraction[-1] if r.backward_fraction else 1.0)
            * r.batches_per_epoch[-1] / r.steps_per_epoch
            for r in runs
        ]
        epoch = np.mean([r.time_per_epoch for r in runs])
        rows.append([
            name,
            len(runs),
            _fmt_stats([r.val_metric for r in runs]),
            _fmt_stats([r.test_metric for r in runs]),
            _fmt_stats([r.best_val_metric for r in runs]),
            _fmt_stats([r.time_per_epoch for r in runs], 1.0, 1),
            _fmt_stats([r.optimizer_updates for r in runs], 1.0, 0),
            ("-" if not reach or any(t is None for t in reach) else _fmt_stats(reach, 1.0, 1)),
            ("-" if not ratios or any(t is None for t in ratios) else _fmt_stats(ratios, 1.0, 2)),
            (f"{epoch / base_epoch:.2f}" if base_epoch else "-"),
            (f"{np.mean([r.epoch_times[-1] for r in runs]) / base_last:.2f}" if base_last else "-"),
            _fmt_stats(masked, 100.0, 1) + "%",
            _fmt_stats(trained, 100.0, 0) + "%",
            _fmt_stats(pearson, 1.0, 2),
        ])
    return _table(header, rows)


def loss_metric_correlation(result):
    """Pearson r between validation loss and metric over a run's evaluations
    (`nan` with fewer than 3 evaluations or a constant series)."""
    loss = np.asarray([e["val_loss"] for e in result.evals], "float64")
    metric = np.asarray([e["val_metric"] for e in result.evals], "float64")
    if len(loss) < 3 or loss.std() == 0 or metric.std() == 0:
        return float("nan")
    return float(np.corrcoef(loss, metric)[0, 1])


# ---------------------------------------------------------------- plotting


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _smooth(values, window):
    values = np.asarray(values, "float64")
    if window <= 1 or len(values) < window:
        return values
    kernel = np.ones(window) / window
    valid = ~np.isnan(values)
    num = np.convolve(np.where(valid, values, 0.0), kernel, mode="valid")
    den = np.convolve(valid.astype("float64"), kernel, mode="valid")
    return np.where(den > 0, num / np.maximum(den, 1e-12), np.nan)


def plot_masked_ratio(results, path=None, smooth=5):
    """Masked ratio vs training step per run (paper Fig. 1); saves a PNG.

    Args:
        results: list of `RunResult`.
        path: where to save the PNG (skipped if `None`).
        smooth: moving-average window in steps.

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in results:
        y = _smooth(r.masked_ratio, smooth)
        x = np.arange(len(y)) + (len(r.masked_ratio) - len(y)) + 1
        label = f"{r.method} (seed {r.seed})"
        if r.method == "softmax":
            label += ", would-mask"
        ax.plot(x, 100 * y, label=label)
    ax.set_xlabel("training step (batch)")
    ax.set_ylabel("masked samples (%)")
    ax.set_title("AS-Softmax masked ratio during training")
    ax.set_ylim(0, 100)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_loss_vs_metric(results, path=None):
    """Validation loss vs validation metric per run, with Pearson r in the
    legend (paper Table 4); saves a PNG.

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4.5))
    for r in results:
        loss = [e["val_loss"] for e in r.evals]
        metric = [100 * e["val_metric"] for e in r.evals]
        corr = loss_metric_correlation(r)
        ax.plot(loss, metric, "o-", alpha=0.8, label=f"{r.method} (seed {r.seed}): r = {corr:.2f}")
    metric_name = results[0].metric_name if results else "metric"
    ax.set_xlabel("validation loss (each method's own)")
    ax.set_ylabel(f"validation {metric_name} (%)")
    ax.set_title("Validation loss vs metric (Pearson r)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig


def plot_margins(results, path=None, bins=40):
    """Histogram of `p_target - max p_other` on the test set (paper Fig. 4);
    saves a PNG.

    Returns:
        The matplotlib `Figure`.
    """
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    edges = np.linspace(-1, 1, bins + 1)
    for r in results:
        ax.hist(r.test_margins, bins=edges, histtype="step", linewidth=1.5, label=f"{r.method} (seed {r.seed})")
    ax.set_xlabel("p_target - max p_other (test set)")
    ax.set_ylabel("samples")
    ax.set_title("Probability margin of the target")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=110)
    return fig
