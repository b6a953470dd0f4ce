"""Softmax vs AS-Softmax vs AS-Speed with its filters, in one command.

Fine-tunes the offline all-MiniLM-L6-v2 (KerasHub `BertBackbone`) on the
bundled WordNet lexicographer-category data (45 classes, real text, no
network) with each method, long enough that most samples get masked, so
that AS-Speed's filters skip real work. Prints a comparison table and a
verdict (is an AS method at least 1.3x faster than softmax at a test
accuracy no more than 2 points lower?), writes three plots to
`--output-dir`, and with `--json PATH` the figures:

* `masked_ratio.png`: masked samples per training step (paper Fig. 1);
* `loss_vs_accuracy.png`: validation loss vs accuracy, Pearson r (Table 4);
* `margins.png`: test-set `p_target - max p_other` histogram (Fig. 4).

Usage:

```
python examples/demo.py                     # ~12 minutes on 2 CPU cores
python examples/demo.py --quick             # smoke test on a tiny random BERT
python examples/demo.py --source clinc_oos  # needs tensorflow-datasets, network
python examples/demo.py --json demo.json    # also writes the figures
```

Every method trains under the same conditions (compiled with XLA, or as a
TensorFlow graph with `--graph`; one repeated shuffled dataset; the same
seed); training
seconds leave out compilation (reported apart) and the validation passes.
"""

import argparse
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "tensorflow")
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help="tiny smoke run (CI)"
    )
    parser.add_argument(
        "--epochs", type=int, default=None, help="epochs per method (default 6)"
    )
    parser.add_argument(
        "--train-size",
        type=int,
        default=None,
        help="training sentences (default 1024)",
    )
    parser.add_argument(
        "--eval-size",
        type=int,
        default=None,
        help="validation and test sentences (default 300)",
    )
    parser.add_argument(
        "--sequence-length",
        type=int,
        default=None,
        help="tokens per sentence (default 32)",
    )
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--learning-rate", type=float, default=1e-4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--preset",
        default=None,
        help="KerasHub BERT preset (default offline-minilm; --quick's: "
        "tiny-random, a one-layer random BERT on MiniLM's tokenizer)",
    )
    parser.add_argument(
        "--source", default="wordnet", choices=("wordnet", "clinc_oos")
    )
    parser.add_argument(
        "--methods",
        default="softmax,as_softmax,as_skip_hybrid",
        help="comma-separated names of as_softmax_lab.METHODS",
    )
    parser.add_argument(
        "--revisit",
        type=float,
        default=0.5,
        help="SkipMaskedLastSeen's revisit probability",
    )
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument(
        "--graph",
        action="store_true",
        help="TensorFlow graphs instead of XLA (--quick's default; JAX "
        "always compiles with XLA)",
    )
    parser.add_argument("--output-dir", default="demo_outputs")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(
        epochs=1 if quick else 6,
        train_size=64 if quick else 1024,
        eval_size=32 if quick else 300,
        sequence_length=24 if quick else 32,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.preset is None:
        args.preset = "tiny-random" if quick else "offline-minilm"
    if quick:
        args.batch_size = min(args.batch_size, 16)
        args.graph = True  # XLA would compile three models: minutes
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    import as_softmax_lab as lab
    from as_softmax_lab import datasets

    methods = args.methods.split(",")
    unknown = [m for m in methods if m not in lab.METHODS]
    if unknown:
        raise SystemExit(
            f"Unknown --methods {', '.join(unknown)}. Expected names among: "
            + ", ".join(lab.METHODS)
        )
    os.makedirs(args.output_dir, exist_ok=True)
    print(f"[demo] loading {args.preset} ...", flush=True)
    backbone = lab.load_backbone(args.preset)
    data = datasets.load_text_classification(
        args.source,
        max_examples={
            "train": args.train_size,
            "validation": args.eval_size,
            "test": args.eval_size,
        },
    )
    prepared = lab.prepare_data(data, backbone.tokenizer, args.sequence_length)
    print(
        f"[demo] {prepared} (loaded in {time.perf_counter() - start:.0f}s)",
        flush=True,
    )

    results = []
    for method in methods:
        t = time.perf_counter()
        print(
            f"[demo] training {method}: {lab.METHODS[method].description}",
            flush=True,
        )
        result = lab.run(
            method,
            prepared,
            backbone,
            seed=args.seed,
            epochs=args.epochs,
            batch_size=args.batch_size,
            learning_rate=args.learning_rate,
            evals_per_epoch=1 if args.quick else 3,
            revisit=args.revisit,
            jit_compile=not args.graph,
            verbose=1,
        )
        results.append(result)
        extra = (
            f", accumulation steps {result.accum_steps[-1]}"
            if result.accum_steps
            else ""
        )
        print(
            f"[demo] {method}: "
            f"val {result.metric_name} {100 * result.val_metric:.2f}, "
            f"test {100 * result.test_metric:.2f}, "
            f"{result.time_per_epoch:.1f}s/epoch "
            f"(+{result.compile_time:.0f}s compile), "
            f"{result.optimizer_updates} updates{extra}, "
            f"{time.perf_counter() - t:.0f}s total",
            flush=True,
        )

    print()
    print(lab.compare(results))
    paths = {
        "masked_ratio.png": lab.plot_masked_ratio,
        "loss_vs_accuracy.png": lab.plot_loss_vs_metric,
        "margins.png": lab.plot_margins,
    }
    for name, plot in paths.items():
        plot(results, os.path.join(args.output_dir, name))
    print(
        f"\n[demo] plots written to {os.path.abspath(args.output_dir)}: "
        f"{', '.join(paths)}"
    )
    print(verdict(results))
    if args.json:
        write_json(results, args.json)
        print(f"[demo] figures written to {args.json}")
    print(f"[demo] wall time {time.perf_counter() - start:.0f}s")
    return 0


def _trained_fraction(result):
    fractions = result.trained_fraction
    return fractions[-1] if fractions else 1.0


def figures(results):
    """`{"methods": {name: {...}}}`: what the demo measured per method."""
    return {
        "methods": {
            r.method: {
                "val_metric": r.val_metric,
                "test_metric": r.test_metric,
                "train_seconds": r.train_time,
                "compile_seconds": r.compile_time,
                "updates": r.optimizer_updates,
                "trained_fraction": _trained_fraction(r),
                "masked_ratio_last_epoch": _last_epoch_masked(r),
            }
            for r in results
        }
    }


def _last_epoch_masked(result):
    import numpy as np

    last = result.masked_ratio[-result.batches_per_epoch[-1] :]
    return float(np.nanmean(last)) if last else float("nan")


def write_json(results, path):
    import json

    with open(path, "w") as f:
        json.dump(figures(results), f, indent=2)


def verdict(results, speedup=1.3, points=2.0):
    """Says plainly whether an AS method met the bar, or that none did."""
    base = next((r for r in results if r.method == "softmax"), None)
    if base is None:
        return "[demo] no softmax run to compare with"
    lines = []
    met = False
    for r in results:
        if r.method == "softmax":
            continue
        ratio = base.train_time / max(r.train_time, 1e-9)
        drop = 100 * (base.test_metric - r.test_metric)
        ok = ratio >= speedup and drop <= points
        met |= ok
        lines.append(
            f"[demo] {r.method}: {ratio:.2f}x softmax's training speed, "
            f"test {-drop:+.2f} points, "
            f"{100 * _last_epoch_masked(r):.0f}% masked in the last epoch, "
            f"trained on {100 * _trained_fraction(r):.0f}% of the drawn "
            "batches in it"
        )
    lines.append(
        f"[demo] an AS method is >= {speedup}x faster at <= {points} points "
        "lower test accuracy: "
        + ("yes" if met else "NO, not on this run (one seed, see the table)")
    )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
