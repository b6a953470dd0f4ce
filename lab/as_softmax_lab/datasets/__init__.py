"""Small text datasets for the examples, demos and benchmarks.

Three loaders, one per task, each with a `source` argument that picks the
data (there is no silent fallback from one source to another):

* `load_text_classification(source="wordnet" | "clinc_oos", ...)`
* `load_multilabel_classification(source="wordnet" | "goemotions", ...)`
* `load_token_classification(source="wordnet" | "conll2003", ...)`

The `"wordnet"` sources are real WordNet 3.0 text bundled with the package
(a few MB, fully offline); the others are read with TensorFlow Datasets.

Example:

```python
from as_softmax_lab import datasets

data = datasets.load_text_classification("wordnet", max_examples=2000)
texts, labels = data.train
print(data)  # ClassificationData(name='wordnet_lexname', num_classes=45, ...)
```
"""

from as_softmax_lab.datasets.loaders import load_multilabel_classification
from as_softmax_lab.datasets.loaders import load_text_classification
from as_softmax_lab.datasets.loaders import load_token_classification
from as_softmax_lab.datasets.structures import ClassificationData
from as_softmax_lab.datasets.structures import TextSplit
from as_softmax_lab.datasets.structures import TokenClassificationData
from as_softmax_lab.datasets.structures import TokenSplit
from as_softmax_lab.datasets.tfds_sources import GOEMOTIONS_LABELS
from as_softmax_lab.datasets.wordnet import load_wordnet_lexname
from as_softmax_lab.datasets.wordnet import load_wordnet_multilabel
from as_softmax_lab.datasets.wordnet import load_wordnet_tokens

__all__ = [
    "ClassificationData",
    "GOEMOTIONS_LABELS",
    "TextSplit",
    "TokenClassificationData",
    "TokenSplit",
    "load_multilabel_classification",
    "load_text_classification",
    "load_token_classification",
    "load_wordnet_lexname",
    "load_wordnet_multilabel",
    "load_wordnet_tokens",
]
