"""ASSpeed's trainer on PyTorch: Keras's torch `train_step`, eager.

The step keeps the shape of Keras's own (`keras/src/backend/torch/
trainer.py`): a forward pass, `loss.backward()`, the gradients read from
`.grad`, and `optimizer.apply` under `torch.no_grad()`. The accumulation
window is `AccumulatingOptimizer`'s, as on the other backends.

The filters run through `_filtering.filtered_step`, as on TensorFlow and
JAX: the same decisions and the same training passes on the same queued
rows. In eager steps the queues are pushed and popped with slices of the
rows kept (`EagerQueue`), which costs a fraction of the static-shape sorts
and gathers that XLA needs; under `torch.compile` (`jit_compile=True`)
they use those (`_queue`), so that every step has one shape.

`keras.ops.cond` is a Python `if` on PyTorch, so the end of a window and
each pass are decided on the host: on a CPU that costs nothing, on a GPU
it waits for the step's work so far.
"""

import contextlib

import keras
import torch
from keras import ops

from keras_as_softmax import filters
from keras_as_softmax.training import _filtering
from keras_as_softmax.training import _queue
from keras_as_softmax.training import _step

_MASK32 = 0xFFFFFFFF


def _mix32(h):
    """MurmurHash3's 32-bit finalizer on int64 tensors holding uint32s."""
    h = h & _MASK32
    h = ((h ^ (h >> 16)) * 0x85EBCA6B) & _MASK32
    h = ((h ^ (h >> 13)) * 0xC2B2AE35) & _MASK32
    return h ^ (h >> 16)


def stateless_uniform(size, seed, counter):
    """`size` uniform draws in [0, 1), a function of `(seed, counter)`.

    A counter-based hash in tensor arithmetic: no generator to seed from a
    host value, so the draws need no device read.
    """
    seed = torch.as_tensor(seed).to(torch.int64)
    counter = torch.as_tensor(counter, device=seed.device).to(torch.int64)
    index = torch.arange(size, dtype=torch.int64, device=seed.device)
    key = _mix32(_mix32(seed) ^ _mix32(counter + 0x9E3779B9))
    bits = _mix32(key ^ _mix32(index * 0x27D4EB2F + 0x165667B1))
    return (bits >> 8).to(torch.float32) * (1.0 / (1 << 24))


def check_not_distributed():
    """Raises a `ValueError` under several `torch.distributed` processes:
    Keras's torch backend has no distribution for `fit` (no
    `keras.distribution`, no gradient all-reduce), so each process would
    train alone."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return
    if dist.get_world_size() > 1:
        raise ValueError(
            "ASSpeed on PyTorch trains on one device: Keras's torch "
            "backend has no distribution support for `fit`. Expected no "
            "torch.distributed process group, or one of a single process. "
            f"Received: a process group of {dist.get_world_size()} "
            "processes. Use KERAS_BACKEND=jax with "
            "keras.distribution.DataParallel, or tensorflow with "
            "tf.distribute, to train on several devices."
        )


def _batch_size(x):
    return next(t for t in keras.tree.flatten(x) if t is not None).shape[0]


def _gradients(variables):
    """The variables' `.grad`, zeros where a variable got none."""
    return [
        torch.zeros_like(v.value) if v.value.grad is None else v.value.grad
        for v in variables
    ]


@contextlib.contextmanager
def _recorded_rows(loss):
    """Records `(y_true, values)` of the loss's `call` inside the block,
    so that the masked rows are counted from the values the step's loss
    computed: an eager step has no compiler to merge a second loss
    computation into the first."""
    recorded = []
    if not isinstance(loss, keras.losses.Loss):
        yield recorded
        return
    own = loss.__dict__.get("call")
    call = loss.call

    def recording(y_true, y_pred):
        values = call(y_true, y_pred)
        recorded.append((y_true, values))
        return values

    loss.call = recording
    try:
        yield recorded
    finally:
        if own is None:
            del loss.call
        else:
            loss.call = own


def _counts(model, recorded, y, y_pred, sample_weight):
    """`(masked, counted)` rows of the step, as float32 scalars."""
    if model.masked_outputs or len(recorded) != 1:
        return model.count_masked(y, y_pred, sample_weight)
    y_true, values = recorded[0]
    counted, masked, _ = _filtering.row_flags(
        model.loss, y_true, ops.cast(values, "float32"), sample_weight
    )
    return (
        torch.sum(masked, dtype=torch.float32),
        torch.sum(counted, dtype=torch.float32),
    )


class EagerQueue:
    """`_queue.push_pop` for eager steps: the same queue (buffers of
    `2 * batch_size` rows and a count) with the same rows waiting, written
    in place with slices instead of static-shape sorts, gathers and a
    scatter. It reads the count on the host."""

    @staticmethod
    def push_pop(queue, rows, keep, size):
        index = torch.nonzero(keep.reshape(-1)).reshape(-1)
        count, taken = int(queue.count), int(index.numel())
        ready = count + taken >= size
        popped = []
        with torch.no_grad():
            for buffer, row in zip(queue.buffers, rows):
                kept = row[index].to(buffer.dtype)
                if ready:
                    front = size - count
                    popped.append(torch.cat([buffer[:count], kept[:front]]))
                    buffer[: taken - front] = kept[front:]
                else:
                    popped.append(buffer[:size].clone())
                    buffer[count : count + taken] = kept
        left = count + taken - size * ready
        return (
            popped,
            torch.tensor(ready, device=queue.count.device),
            _queue.RowQueue(queue.buffers, queue.count + (left - count)),
        )


class _Hooks:
    """The passes of `_filtering.filtered_step` on PyTorch: `maybe_score`
    and `maybe_train` run `score` and `train` only when their predicate
    holds (one boolean read on the host). A training pass returns its
    gradients, for the optimizer's `apply`."""

    def __init__(self, model):
        self.model = model

    def maybe_score(self, pred, x):
        """`(y_pred, penalty)` of the scoring pass if `pred`, else zeros."""
        if bool(pred):
            return self.score(x)
        return self.no_output(x), keras.ops.zeros((), "float32")

    def maybe_train(self, pred, x, y, coefficients):
        """`train`'s results if `pred`, else zeros."""
        if bool(pred):
            return self.train(x, y, coefficients)
        zero = torch.zeros((), dtype=torch.float32)
        return (
            None,
            self.no_output(x),
            torch.zeros_like(coefficients),
            zero.to(coefficients.device),
        )

    def train(self, x, y, coefficients):
        """`(grads, y_pred, values, loss)` of a training pass minimising
        `sum(coefficients * values)`."""
        model = self.model
        variables = model.trainable_variables
        with torch.enable_grad():
            y_pred = model.inner_model(x, training=True)
            model.check_step_outputs(y_pred)
            model.zero_grad()
            values = _filtering.row_values(model.loss, y, y_pred)
            penalty = _filtering.penalty(model, model.losses)
            loss = torch.sum(coefficients * values) + penalty
            model.optimizer.scale_loss(loss).backward()
        grads = _gradients(variables)
        return grads, y_pred.detach(), values.detach(), loss.detach()

    def no_output(self, x):
        """Zeros in the shape of the model's output for `x`."""
        return self.model.filter_engine.no_output(_batch_size(x))

    def score(self, x):
        """A forward pass in training mode, its moving statistics put back
        (`_filtering.moving_statistics`); in inference mode with
        `SkipMasked(score_training=False)`."""
        model = self.model
        if not model.filter_engine.score_training:
            y_pred = model.inner_model(x, training=False)
            model.check_step_outputs(y_pred)
            return y_pred, _filtering.penalty(model, model.losses)
        saved_variables = _filtering.moving_statistics(model)
        saved = [v.value.clone() for v in saved_variables]
        y_pred = model.inner_model(x, training=True)
        model.check_step_outputs(y_pred)
        for v, value in zip(saved_variables, saved):
            v.assign(value)
        return y_pred, _filtering.penalty(model, model.losses)


class _Step:
    """The stages of `_step.train_step` on PyTorch: eager, every tensor
    that needs no gradient computed under `torch.no_grad()`."""

    def __init__(self, model):
        self.model = model
        if not model.optimizer.built:
            model.optimizer.build(model.trainable_variables)

    def filtered(self, x, y, sample_weight):
        model = self.model
        # In eager steps the queues move rows with slices (`EagerQueue`);
        # under `torch.compile`, with static-shape gathers.
        queue_ops = _queue if model.jit_compile else EagerQueue
        # Only the training pass needs a graph (`_Hooks.maybe_train`).
        with torch.no_grad():
            inputs, output = model.filter_engine.step(
                model.loss,
                x,
                y,
                sample_weight,
                _Hooks(model),
                stateless_uniform,
                queue_ops=queue_ops,
            )
        return _step.filtered_result(inputs, output)

    def plain(self, x, y, sample_weight):
        model = self.model
        inputs, _ = filters.split_sample_ids(x)
        y_pred = model.inner_model(inputs, training=True)
        model.zero_grad()
        with _recorded_rows(model.loss) as recorded:
            loss = model.compute_loss(inputs, y, y_pred, sample_weight)
        model.optimizer.scale_loss(loss).backward()
        grads = _gradients(model.trainable_variables)
        with torch.no_grad():
            counts = _counts(model, recorded, y, y_pred, sample_weight)
        return _step.plain_result(
            grads,
            counts,
            loss.detach(),
            _batch_size(x),
            inputs,
            y,
            y_pred,
            sample_weight,
        )

    def apply(self, result):
        model = self.model
        with torch.no_grad():
            model.optimizer.apply(
                result.grads,
                model.trainable_variables,
                rows=result.rows,
                masked_rows=result.masked,
            )

    def logs(self, result):
        with torch.no_grad():
            return _step.update_logs(self.model, result)


class ASSpeedTrainer:
    """`train_step` and `test_step` of `ASSpeed` on PyTorch, eager (or
    under `torch.compile` with `jit_compile=True`)."""

    def train_step(self, data):
        return _step.train_step(_Step(self), data)

    def test_step(self, data):
        return super().test_step(_step.without_ids(data))
