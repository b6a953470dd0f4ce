"""The experiment harness: softmax vs AS-Softmax vs AS-Speed.

Used by the examples, notebooks, benchmarks and tests; not part of the
`keras-as-softmax` wheel. One run fine-tunes a KerasHub BERT backbone (by
default the offline all-MiniLM-L6-v2) on one of three task types:

* `"multiclass"`: a `ClassificationData` with integer labels (accuracy);
* `"multilabel"`: a `ClassificationData` with multi-hot labels (micro-F1,
  a class is predicted where its logit is > 0);
* `"tokens"`: a `TokenClassificationData` of BIO tags (entity-level F1,
  seqeval-style, see `bio_f1_score`).

One module per job: `methods` (what each method trains with), `datasets`
and `data` (loading, tokenizing), `backbones` and `models` (the BERT
classifier), `runner` (one measured run), `task_metrics`, `report` (tables),
`time_to_target` (time to a quality target) and `plots` (figures). The
names below are their public parts. What the speed benchmarks share with
the lab's scripts is imported from its own module, not from here:
`timing` (the timing loop), `tiny_mlp` and `random_bert` (the models).

Example:

```python
import as_softmax_lab as lab

backbone = lab.load_backbone("offline-minilm")
data = lab.datasets.load_text_classification("wordnet", max_examples=500)
prepared = lab.prepare_data(data, backbone.tokenizer, 32)
results = [
    lab.run(method, prepared, backbone, seed=0, epochs=2)
    for method in lab.METHODS
]
print(lab.compare(results))
lab.plot_masked_ratio(results, "masked_ratio.png")
```
"""

from as_softmax_lab import backbones
from as_softmax_lab import datasets
from as_softmax_lab import time_to_target
from as_softmax_lab.data import PreparedData
from as_softmax_lab.data import make_dataset
from as_softmax_lab.data import prepare_data
from as_softmax_lab.data import tokenize_tagged
from as_softmax_lab.data import tokenize_texts
from as_softmax_lab.methods import BASELINE_METHODS
from as_softmax_lab.methods import DEFAULT_DELTA
from as_softmax_lab.methods import IGNORE_CLASS
from as_softmax_lab.methods import METHODS
from as_softmax_lab.methods import METRIC_NAMES
from as_softmax_lab.methods import RECOMMENDED
from as_softmax_lab.methods import TASKS
from as_softmax_lab.methods import LabelSmoothingLoss
from as_softmax_lab.methods import Method
from as_softmax_lab.methods import make_loss
from as_softmax_lab.methods import parse_method
from as_softmax_lab.methods import wrap_model
from as_softmax_lab.models import Backbone
from as_softmax_lab.models import build_classifier
from as_softmax_lab.models import build_scratch_classifier
from as_softmax_lab.models import load_backbone
from as_softmax_lab.models import tiny_backbone
from as_softmax_lab.plots import plot_loss_vs_metric
from as_softmax_lab.plots import plot_margins
from as_softmax_lab.plots import plot_masked_ratio
from as_softmax_lab.plots import plot_time_to_target
from as_softmax_lab.report import compare
from as_softmax_lab.report import loss_metric_correlation
from as_softmax_lab.runner import RunResult
from as_softmax_lab.runner import run
from as_softmax_lab.task_metrics import bio_f1_score
from as_softmax_lab.task_metrics import bio_spans
from as_softmax_lab.task_metrics import micro_f1
from as_softmax_lab.task_metrics import probability_margins
from as_softmax_lab.task_metrics import task_metric
