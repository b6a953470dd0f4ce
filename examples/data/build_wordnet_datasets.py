"""Build the small offline WordNet 3.0 datasets bundled with the lab package.

The three datasets are built from the plain-text WordNet 3.0 database that
Debian ships in the `wordnet-base` package (`apt-get install wordnet-base`,
files under `/usr/share/wordnet`). They are real, human-written text: the
definitions ("glosses") and the quoted example sentences of WordNet synsets,
labelled with WordNet's own lexicographer categories ("lexnames", also known
as supersenses: `noun.animal`, `verb.motion`, ...).

Outputs (gzip-compressed JSON, written deterministically) in
`lab/as_softmax_lab/datasets/data/`:

* `wordnet_lexname.json.gz` -- multi-class. Text: a synset's definition
  (the gloss without its example sentences and without the synset's lemmas).
  Label: the synset's lexicographer category (45 classes).
* `wordnet_multilabel.json.gz` -- multi-label. One example per polysemous
  lemma (a word with at least two senses, counting all parts of speech).
  Text: the definitions of (up to `--max-senses` of) its senses, in random
  order, joined with `" | "`; the lemma itself is not part of the text.
  Labels: the set of lexicographer categories of those senses.
* `wordnet_tokens.json.gz` -- token classification (BIO). Sentences: the
  quoted example sentences of the glosses, tokenised into words and
  punctuation. The word(s) realising the synset's lemma (matched with
  WordNet's exception lists and regular inflection rules) are tagged
  `B-<type>`/`I-<type>`, all other tokens `O`. `<type>` is the synset's
  lexname for nouns and verbs, `adj` for all adjectives and `adv` for adverbs;
  noun/verb lexnames with fewer than `--min-type-count` usable sentences are
  folded into `noun.other`/`verb.other`.

Every dataset has fixed `train`/`validation`/`test` splits drawn with a fixed
seed; rebuilding with the same WordNet files and arguments gives byte-identical
files.

Usage:

```
apt-get install wordnet-base
python examples/data/build_wordnet_datasets.py
```
"""

import argparse
import collections
import gzip
import json
import os
import random
import re
import sys

# The standard table of WordNet 3.0 lexicographer files (see lexnames(5WN)).
# Debian's `wordnet-base` does not ship the `lexnames` file itself.
LEXNAMES = (
    "adj.all",
    "adj.pert",
    "adv.all",
    "noun.Tops",
    "noun.act",
    "noun.animal",
    "noun.artifact",
    "noun.attribute",
    "noun.body",
    "noun.cognition",
    "noun.communication",
    "noun.event",
    "noun.feeling",
    "noun.food",
    "noun.group",
    "noun.location",
    "noun.motive",
    "noun.object",
    "noun.person",
    "noun.phenomenon",
    "noun.plant",
    "noun.possession",
    "noun.process",
    "noun.quantity",
    "noun.relation",
    "noun.shape",
    "noun.state",
    "noun.substance",
    "noun.time",
    "verb.body",
    "verb.change",
    "verb.cognition",
    "verb.communication",
    "verb.competition",
    "verb.consumption",
    "verb.contact",
    "verb.creation",
    "verb.emotion",
    "verb.motion",
    "verb.perception",
    "verb.possession",
    "verb.social",
    "verb.stative",
    "verb.weather",
    "adj.ppl",
)

POS_FILES = ("noun", "verb", "adj", "adv")
SOURCE = "WordNet 3.0, Princeton University (Debian package wordnet-base)"
# Written into every file: changing it changes the bundled bytes (the path is
# where the data lived when the files were built).
LICENSE = (
    "WordNet 3.0 license: WordNet 3.0 Copyright 2006 by Princeton University. "
    "All rights reserved. See keras_as_softmax/datasets/data/README.md."
)
DEFAULT_OUTPUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    os.pardir,
    os.pardir,
    "lab",
    "as_softmax_lab",
    "datasets",
    "data",
)

# Words, optionally hyphenated or with inner periods ("U.S"), clitics such as
# "'s" as their own token, and any other non-space character as punctuation.
_TOKEN_RE = re.compile(r"[^\W_]+(?:[-.][^\W_]+)*|'[^\W_]+|[^\w\s]|_")
_ADJ_MARKER_RE = re.compile(r"\((?:a|p|ip)\)$")
_VOWELS = set("aeiou")


def tokenize(text):
    """Splits text into word and punctuation tokens."""
    return _TOKEN_RE.findall(text)


# -----------------------------------------------------------------------------
# Reading WordNet.
# -----------------------------------------------------------------------------


class Synset(
    collections.namedtuple(
        "Synset", "key pos lexname lemmas definition examples"
    )
):
    """One WordNet synset, as read from a `data.*` file."""


def split_gloss(gloss):
    """Splits a gloss into its definition and its quoted example sentences.

    Examples are the double-quoted strings; the definition is the text before
    the first one. Most glosses separate them with `; `, a few with `:`, `,`
    or `e.g.`, which are stripped too.
    """
    gloss = gloss.strip()
    start = gloss.find('"')
    if start < 0:
        definition, rest = gloss, ""
    else:
        definition, rest = gloss[:start], gloss[start:]
    examples = [e.strip() for e in re.findall(r'"([^"]*)"', rest)]
    examples = [e for e in examples if e]
    definition = re.sub(r"[\s;:,]*(?:e\.g\.[\s,]*)?$", "", definition)
    return definition.strip(), examples


def read_synsets(wordnet_dir):
    """Reads all synsets of the four `data.*` files, in file order."""
    synsets = []
    for pos_file in POS_FILES:
        path = os.path.join(wordnet_dir, "data." + pos_file)
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):  # Licence header.
                    continue
                head, gloss = line.split("|", 1)
                fields = head.split()
                offset, lex_filenum, ss_type = fields[0], fields[1], fields[2]
                w_cnt = int(fields[3], 16)
                lemmas = []
                for i in range(w_cnt):
                    word = _ADJ_MARKER_RE.sub("", fields[4 + 2 * i])
                    lemmas.append(word)
                definition, examples = split_gloss(gloss)
                pos = "a" if ss_type == "s" else ss_type
                synsets.append(
                    Synset(
                        key=pos + offset,
                        pos=pos,
                        lexname=LEXNAMES[int(lex_filenum)],
                        lemmas=tuple(lemmas),
                        definition=definition,
                        examples=tuple(examples),
                    )
                )
    return synsets


def read_index(wordnet_dir):
    """Reads `index.*`: lemma -> {pos: [synset keys in sense order]}."""
    index = collections.defaultdict(dict)
    for pos_file in POS_FILES:
        path = os.path.join(wordnet_dir, "index." + pos_file)
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("  "):
                    continue
                fields = line.split()
                lemma, pos = fields[0], fields[1]
                synset_cnt = int(fields[2])
                offsets = fields[-synset_cnt:]
                index[lemma][pos] = [pos + offset for offset in offsets]
    return index


def read_exceptions(wordnet_dir):
    """Reads `*.exc`: pos -> base form -> set of irregular inflections."""
    exceptions = {}
    for pos, pos_file in (
        ("n", "noun"),
        ("v", "verb"),
        ("a", "adj"),
        ("r", "adv"),
    ):
        table = collections.defaultdict(set)
        path = os.path.join(wordnet_dir, pos_file + ".exc")
        if os.path.exists(path):
            with open(path, encoding="utf-8", errors="replace") as f:
                for line in f:
                    fields = line.split()
                    if len(fields) >= 2:
                        for base in fields[1:]:
                            table[base.lower()].add(fields[0].lower())
        exceptions[pos] = table
    return exceptions


# -----------------------------------------------------------------------------
# Morphology and lemma matching for the token dataset.
# -----------------------------------------------------------------------------


def _doubles_final_consonant(word):
    return (
        len(word) >= 3
        and word[-1] not in _VOWELS
        and word[-1] not in "wxy"
        and word[-2] in _VOWELS
        and word[-3] not in _VOWELS
    )


def inflections(word, pos, exceptions):
    """Returns the set of surface forms of `word` for part of speech `pos`."""
    word = word.lower()
    forms = {word} | exceptions[pos].get(word, set())
    if not word.isalpha():
        return forms
    consonant_y = len(word) >= 2 and word[-1] == "y" and word[-2] not in _VOWELS
    sibilant = word.endswith(("s", "x", "z", "ch", "sh"))
    if pos in ("n", "v"):
        if consonant_y:
            forms.add(word[:-1] + "ies")
        elif sibilant:
            forms.add(word + "es")
        else:
            forms.add(word + "s")
        if word.endswith("o"):
            forms.add(word + "es")
    if pos == "v":
        if word.endswith("e"):
            forms.update({word + "d", word[:-1] + "ing"})
            if word.endswith(("ee", "ye", "oe")):
                forms.add(word + "ing")
        elif consonant_y:
            forms.update({word[:-1] + "ied", word + "ing"})
        else:
            forms.update({word + "ed", word + "ing"})
            if _doubles_final_consonant(word):
                forms.update({word + word[-1] + "ed", word + word[-1] + "ing"})
        if word.endswith("ie"):
            forms.add(word[:-2] + "ying")
    if pos == "a":
        if word.endswith("e"):
            forms.update({word + "r", word + "st"})
        elif consonant_y:
            forms.update({word[:-1] + "ier", word[:-1] + "iest"})
        else:
            forms.update({word + "er", word + "est"})
            if _doubles_final_consonant(word):
                forms.update({word + word[-1] + "er", word + word[-1] + "est"})
    return forms


def lemma_patterns(lemma, pos, exceptions):
    """Returns the token patterns (tuples of sets of forms) of a lemma."""
    words = [w.lower() for w in tokenize(lemma.replace("_", " "))]
    if not words or (len(words) == 1 and len(words[0]) < 2):
        return []
    pattern = [{w} for w in words]
    if len(words) == 1:
        pattern[0] = inflections(words[0], pos, exceptions)
    elif pos == "v":  # Phrasal verbs inflect their first word ("looked up").
        pattern[0] = inflections(words[0], pos, exceptions)
    elif pos == "n":  # Compound nouns inflect their last word.
        pattern[-1] = inflections(words[-1], pos, exceptions)
    return [tuple(pattern)]


def find_spans(tokens, pattern):
    """Returns non-overlapping (start, end) spans of `tokens` that match."""
    lowered = [t.lower() for t in tokens]
    spans = []
    i, n = 0, len(pattern)
    while i + n <= len(lowered):
        if all(lowered[i + j] in pattern[j] for j in range(n)):
            spans.append((i, i + n))
            i += n
        else:
            i += 1
    return spans


def tag_type(synset, kept_types):
    """Returns the BIO entity type of a synset's lemma in its examples."""
    if synset.pos == "a":
        return "adj"
    if synset.pos == "r":
        return "adv"
    if kept_types is None or synset.lexname in kept_types:
        return synset.lexname
    return synset.lexname.split(".")[0] + ".other"


def tag_example(synset, example, exceptions):
    """Tokenises one example sentence and locates its synset's lemma.

    Returns `(tokens, spans)` or `None` if no lemma of the synset is found.
    Among the synset's lemmas that occur, the longest one (in tokens) wins,
    then the first one in WordNet's order; all its occurrences are tagged.
    """
    tokens = tokenize(example)
    if not tokens:
        return None
    best = None
    for lemma in synset.lemmas:
        for pattern in lemma_patterns(lemma, synset.pos, exceptions):
            spans = find_spans(tokens, pattern)
            if spans and (best is None or len(pattern) > best[0]):
                best = (len(pattern), spans)
    if best is None:
        return None
    return tokens, best[1]


# -----------------------------------------------------------------------------
# Splitting helpers.
# -----------------------------------------------------------------------------


def stratified_split(items, label_of, sizes, min_per_class, rng):
    """Draws a stratified sample and splits it into train/validation/test.

    Args:
        items: list of examples.
        label_of: function from an example to its class.
        sizes: dict with the target sizes of "train", "validation", "test".
        min_per_class: every class keeps at least this many examples (or all
            of them if it has fewer), so rare classes are not lost.
        rng: `random.Random`.

    Returns:
        Dict from split name to list of examples.
    """
    total = sum(sizes.values())
    by_class = collections.defaultdict(list)
    for item in items:
        by_class[label_of(item)].append(item)
    fraction = min(1.0, total / len(items))
    out = {name: [] for name in sizes}
    for label in sorted(by_class):
        members = by_class[label]
        rng.shuffle(members)
        k = max(
            min(len(members), min_per_class), round(len(members) * fraction)
        )
        members = members[:k]
        n_test = round(k * sizes["test"] / total)
        n_val = round(k * sizes["validation"] / total)
        if k >= 3:
            n_test, n_val = max(1, n_test), max(1, n_val)
        out["test"].extend(members[:n_test])
        out["validation"].extend(members[n_test : n_test + n_val])
        out["train"].extend(members[n_test + n_val :])
    for name in out:
        rng.shuffle(out[name])
    return out


def random_split(items, sizes, rng):
    """Shuffles `items` and cuts test, validation and train in that order."""
    items = list(items)
    rng.shuffle(items)
    n_test, n_val = sizes["test"], sizes["validation"]
    return {
        "test": items[:n_test],
        "validation": items[n_test : n_test + n_val],
        "train": items[n_test + n_val : n_test + n_val + sizes["train"]],
    }


# -----------------------------------------------------------------------------
# The three datasets.
# -----------------------------------------------------------------------------


def build_lexname(synsets, sizes, seed):
    """Multi-class: definition -> lexicographer category."""
    rng = random.Random(seed)
    labels_of_text = collections.defaultdict(set)
    for s in synsets:
        if s.definition:
            labels_of_text[s.definition].add(s.lexname)
    seen = set()
    items = []
    for s in synsets:
        text = s.definition
        # Drop empty definitions, duplicates and definitions shared by
        # synsets of different categories (their label would be ambiguous).
        if not text or text in seen or len(labels_of_text[text]) != 1:
            continue
        seen.add(text)
        items.append((s.key, text, LEXNAMES.index(s.lexname)))
    splits = stratified_split(
        items, lambda item: item[2], sizes, min_per_class=30, rng=rng
    )
    return {
        "name": "wordnet_lexname",
        "task": "multiclass",
        "description": (
            "WordNet 3.0 synset definitions (glosses without example "
            "sentences and without the synset's words) labelled with the "
            "synset's lexicographer category (supersense). Stratified sample, "
            "every category keeps at least 30 examples."
        ),
        "class_names": list(LEXNAMES),
        "splits": {
            name: {
                "ids": [item[0] for item in split],
                "texts": [item[1] for item in split],
                "labels": [item[2] for item in split],
            }
            for name, split in splits.items()
        },
    }


def build_multilabel(synsets, index, sizes, seed, max_senses):
    """Multi-label: definitions of a lemma's senses -> their lexnames."""
    rng = random.Random(seed)
    by_key = {s.key: s for s in synsets}
    items = []
    seen_texts = set()
    for lemma in sorted(index):
        per_pos = [index[lemma][pos] for pos in "nvar" if pos in index[lemma]]
        if sum(len(keys) for keys in per_pos) < 2:
            continue
        # Round-robin over parts of speech, each in WordNet's sense order
        # (most frequent sense first), so that every part of speech is
        # represented when senses are capped.
        chosen = []
        for rank in range(max(len(keys) for keys in per_pos)):
            for keys in per_pos:
                if rank < len(keys) and len(chosen) < max_senses:
                    chosen.append(by_key[keys[rank]])
        chosen = [s for s in chosen if s.definition]
        if len(chosen) < 2:
            continue
        rng.shuffle(chosen)
        text = " | ".join(s.definition for s in chosen)
        if text in seen_texts:
            continue
        seen_texts.add(text)
        labels = sorted({LEXNAMES.index(s.lexname) for s in chosen})
        items.append((lemma, text, labels))
    splits = random_split(items, sizes, rng)
    return {
        "name": "wordnet_multilabel",
        "task": "multilabel",
        "description": (
            "One example per polysemous WordNet 3.0 lemma (at least two "
            f"senses over all parts of speech). Text: the definitions of up "
            f"to {max_senses} of its senses (round-robin over parts of speech "
            "in sense-frequency order, then shuffled), joined with ' | '; the "
            "lemma itself is not in the text. Labels: the set of "
            "lexicographer categories of those senses."
        ),
        "class_names": list(LEXNAMES),
        "splits": {
            name: {
                "ids": [item[0] for item in split],
                "texts": [item[1] for item in split],
                "labels": [item[2] for item in split],
            }
            for name, split in splits.items()
        },
    }


def build_tokens(synsets, exceptions, sizes, seed, min_type_count):
    """Token classification: BIO tags of the synset's lemma in its examples."""
    rng = random.Random(seed)
    tagged = []  # (synset, tokens, spans)
    seen = set()
    for s in synsets:
        for example in s.examples:
            result = tag_example(s, example, exceptions)
            if result is None:
                continue
            tokens, spans = result
            key = tuple(tokens)
            if key in seen:  # The same sentence under several synsets.
                continue
            seen.add(key)
            tagged.append((s, tokens, spans))
    counts = collections.Counter(s.lexname for s, _, _ in tagged)
    kept_types = {
        name
        for name, count in counts.items()
        if count >= min_type_count and name.split(".")[0] in ("noun", "verb")
    }
    types = sorted({tag_type(s, kept_types) for s, _, _ in tagged})
    tag_names = ["O"]
    for t in types:
        tag_names += ["B-" + t, "I-" + t]
    tag_id = {name: i for i, name in enumerate(tag_names)}

    # Split by synset, so that no synset has sentences in two splits.
    by_synset = collections.defaultdict(list)
    for s, tokens, spans in tagged:
        by_synset[s.key].append((s, tokens, spans))
    keys = sorted(by_synset)
    rng.shuffle(keys)
    splits = {"test": [], "validation": [], "train": []}
    for key in keys:
        for name in ("test", "validation", "train"):
            if len(splits[name]) < sizes[name]:
                splits[name].extend(by_synset[key])
                break
    out = {}
    for name, examples in splits.items():
        examples = examples[: sizes[name]]
        rng.shuffle(examples)
        ids, all_tokens, all_tags = [], [], []
        for s, tokens, spans in examples:
            t = tag_type(s, kept_types)
            tags = [0] * len(tokens)
            for start, end in spans:
                tags[start] = tag_id["B-" + t]
                for i in range(start + 1, end):
                    tags[i] = tag_id["I-" + t]
            ids.append(s.key)
            all_tokens.append(tokens)
            all_tags.append(tags)
        out[name] = {"ids": ids, "tokens": all_tokens, "tags": all_tags}
    return {
        "name": "wordnet_tokens",
        "task": "token_classification",
        "description": (
            "Quoted example sentences of WordNet 3.0 glosses, tokenised into "
            "words and punctuation. The tokens realising the synset's lemma "
            "(inflections matched with WordNet's exception lists and regular "
            "suffix rules) are tagged B-/I-<type>, all others O. <type> is the "
            "lexicographer category for nouns and verbs (categories with "
            f"fewer than {min_type_count} sentences folded into noun.other / "
            "verb.other), 'adj' for adjectives and 'adv' for adverbs. Split by "
            "synset."
        ),
        "class_names": tag_names,
        "splits": out,
    }


# -----------------------------------------------------------------------------
# Output.
# -----------------------------------------------------------------------------


def write_dataset(dataset, output_dir, seed):
    dataset = dict(dataset, source=SOURCE, license=LICENSE, seed=seed)
    path = os.path.join(output_dir, dataset["name"] + ".json.gz")
    payload = json.dumps(
        dataset, ensure_ascii=False, separators=(",", ":"), sort_keys=True
    ).encode("utf-8")
    with open(path, "wb") as raw:
        # mtime=0 and no file name make the output byte-for-byte reproducible.
        with gzip.GzipFile(
            filename="", mode="wb", fileobj=raw, compresslevel=9, mtime=0
        ) as f:
            f.write(payload)
    return path


def summarize(dataset):
    lines = [dataset["name"] + ":"]
    num_classes = len(dataset["class_names"])
    for name, split in dataset["splits"].items():
        labels = split.get("labels", split.get("tags"))
        counts = collections.Counter()
        for label in labels:
            if isinstance(label, list):
                counts.update(label)
            else:
                counts[label] += 1
        if "tokens" in split:
            extra = f"tokens={sum(len(t) for t in split['tokens'])}"
        elif labels and isinstance(labels[0], list):
            mean = sum(len(lab) for lab in labels) / max(1, len(labels))
            extra = f"mean labels/example={mean:.2f}"
        else:
            extra = ""
        lines.append(
            f"  {name}: n={len(labels)} classes present={len(counts)}/"
            f"{num_classes} {extra}"
        )
    return "\n".join(lines)


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--wordnet-dir", default="/usr/share/wordnet")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument(
        "--lexname-sizes",
        type=int,
        nargs=3,
        default=(20000, 2000, 2000),
        metavar=("TRAIN", "VAL", "TEST"),
    )
    parser.add_argument(
        "--multilabel-sizes",
        type=int,
        nargs=3,
        default=(12000, 1500, 1500),
        metavar=("TRAIN", "VAL", "TEST"),
    )
    parser.add_argument(
        "--token-sizes",
        type=int,
        nargs=3,
        default=(20000, 2000, 2000),
        metavar=("TRAIN", "VAL", "TEST"),
    )
    parser.add_argument("--max-senses", type=int, default=6)
    parser.add_argument("--min-type-count", type=int, default=400)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    data_file = os.path.join(args.wordnet_dir, "data.noun")
    if not os.path.exists(data_file):
        raise SystemExit(
            f"WordNet database not found: expected {data_file}. Install it "
            "with `apt-get install wordnet-base` or pass --wordnet-dir."
        )

    def sizes(values):
        return dict(zip(("train", "validation", "test"), values, strict=True))

    synsets = read_synsets(args.wordnet_dir)
    index = read_index(args.wordnet_dir)
    exceptions = read_exceptions(args.wordnet_dir)
    os.makedirs(args.output_dir, exist_ok=True)
    datasets = [
        build_lexname(synsets, sizes(args.lexname_sizes), args.seed),
        build_multilabel(
            synsets,
            index,
            sizes(args.multilabel_sizes),
            args.seed,
            args.max_senses,
        ),
        build_tokens(
            synsets,
            exceptions,
            sizes(args.token_sizes),
            args.seed,
            args.min_type_count,
        ),
    ]
    for dataset in datasets:
        path = write_dataset(dataset, args.output_dir, args.seed)
        print(summarize(dataset))
        print(f"  -> {os.path.normpath(path)} ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    sys.exit(main())
