"""Adaptive Sparse Softmax (AS-Softmax) and AS-Speed for Keras 3."""

from keras_as_softmax import filters
from keras_as_softmax.callbacks import DeltaWarmup
from keras_as_softmax.losses import AMSoftmaxLoss
from keras_as_softmax.losses import ASSoftmaxLoss
from keras_as_softmax.losses import Entmax15Loss
from keras_as_softmax.losses import MultiLabelASSoftmaxLoss
from keras_as_softmax.losses import MultiLabelCategoricalCrossentropy
from keras_as_softmax.losses import SparsemaxLoss
from keras_as_softmax.losses import SparseSoftmaxLoss
from keras_as_softmax.losses import TemperatureSoftmaxLoss
from keras_as_softmax.losses import am_softmax_cross_entropy
from keras_as_softmax.losses import as_softmax_cross_entropy
from keras_as_softmax.losses import entmax15
from keras_as_softmax.losses import entmax15_loss
from keras_as_softmax.losses import multilabel_as_softmax_cross_entropy
from keras_as_softmax.losses import multilabel_categorical_crossentropy
from keras_as_softmax.losses import sparse_softmax_cross_entropy
from keras_as_softmax.losses import sparsemax
from keras_as_softmax.losses import sparsemax_loss
from keras_as_softmax.losses import temperature_softmax_cross_entropy
from keras_as_softmax.metrics import MaskedRatio
from keras_as_softmax.metrics import count_masked_rows
from keras_as_softmax.metrics import masked_rows
from keras_as_softmax.training.accumulation import AdaptiveSteps
from keras_as_softmax.training.accumulation import FixedSteps
from keras_as_softmax.training.as_speed import ASSpeed
from keras_as_softmax.training.optimizer import AccumulatingOptimizer

__all__ = [
    "AMSoftmaxLoss",
    "ASSoftmaxLoss",
    "ASSpeed",
    "AccumulatingOptimizer",
    "AdaptiveSteps",
    "DeltaWarmup",
    "Entmax15Loss",
    "FixedSteps",
    "MaskedRatio",
    "MultiLabelASSoftmaxLoss",
    "MultiLabelCategoricalCrossentropy",
    "SparseSoftmaxLoss",
    "SparsemaxLoss",
    "TemperatureSoftmaxLoss",
    "am_softmax_cross_entropy",
    "as_softmax_cross_entropy",
    "count_masked_rows",
    "entmax15",
    "entmax15_loss",
    "filters",
    "masked_rows",
    "multilabel_as_softmax_cross_entropy",
    "multilabel_categorical_crossentropy",
    "sparse_softmax_cross_entropy",
    "sparsemax",
    "sparsemax_loss",
    "temperature_softmax_cross_entropy",
]

__version__ = "0.6.0"
