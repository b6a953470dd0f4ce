"""AS-Softmax losses and the baselines of the paper."""

from keras_as_softmax.losses.as_softmax import ASSoftmaxLoss
from keras_as_softmax.losses.as_softmax import as_softmax_cross_entropy
from keras_as_softmax.losses.baselines import AMSoftmaxLoss
from keras_as_softmax.losses.baselines import Entmax15Loss
from keras_as_softmax.losses.baselines import SparsemaxLoss
from keras_as_softmax.losses.baselines import SparseSoftmaxLoss
from keras_as_softmax.losses.baselines import TemperatureSoftmaxLoss
from keras_as_softmax.losses.baselines import am_softmax_cross_entropy
from keras_as_softmax.losses.baselines import entmax15
from keras_as_softmax.losses.baselines import entmax15_loss
from keras_as_softmax.losses.baselines import sparse_softmax_cross_entropy
from keras_as_softmax.losses.baselines import sparsemax
from keras_as_softmax.losses.baselines import sparsemax_loss
from keras_as_softmax.losses.baselines import temperature_softmax_cross_entropy
from keras_as_softmax.losses.multilabel import MultiLabelASSoftmaxLoss
from keras_as_softmax.losses.multilabel import MultiLabelCategoricalCrossentropy
from keras_as_softmax.losses.multilabel import (
    multilabel_as_softmax_cross_entropy,
)
from keras_as_softmax.losses.multilabel import (
    multilabel_categorical_crossentropy,
)

__all__ = [
    "ASSoftmaxLoss",
    "as_softmax_cross_entropy",
    "AMSoftmaxLoss",
    "Entmax15Loss",
    "SparsemaxLoss",
    "SparseSoftmaxLoss",
    "TemperatureSoftmaxLoss",
    "am_softmax_cross_entropy",
    "entmax15",
    "entmax15_loss",
    "sparse_softmax_cross_entropy",
    "sparsemax",
    "sparsemax_loss",
    "temperature_softmax_cross_entropy",
    "MultiLabelASSoftmaxLoss",
    "MultiLabelCategoricalCrossentropy",
    "multilabel_as_softmax_cross_entropy",
    "multilabel_categorical_crossentropy",
]
