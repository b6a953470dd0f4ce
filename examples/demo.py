"""Does AS-Speed reach softmax's accuracy sooner? One command answers.

Fine-tunes the offline all-MiniLM-L6-v2 (KerasHub `BertBackbone`) on the
bundled WordNet lexicographer-category data (45 classes, real text, no
network) with softmax and with the recommended AS setting
(`as_softmax_lab.RECOMMENDED`), evaluating twice an epoch, and answers
the question MLPerf asks of a faster trainer: did it reach the target
(99% of softmax's best validation accuracy) in fewer training seconds?
Prints a comparison table and that verdict, writes three plots to
`--output-dir`, and with `--json PATH` the figures:

* `masked_ratio.png`: masked samples per training step (paper Fig. 1);
* `loss_vs_accuracy.png`: validation loss vs accuracy, Pearson r (Table 4);
* `margins.png`: test-set `p_target - max p_other` histogram (Fig. 4).

Usage:

```
python examples/demo.py                     # ~15 minutes on 2 CPU cores
python examples/demo.py --quick             # smoke test on a tiny random BERT
python examples/demo.py --methods softmax,as_softmax,as_skip/learning_rate=2e-4
python examples/demo.py --source clinc_oos  # needs tensorflow-datasets, network
python examples/demo.py --json demo.json    # also writes the figures
```

A method is a name of `as_softmax_lab.METHODS`, optionally with settings
of its own (`name/key=value/...`, as in `benchmarks/as_speed.py`). Every
method trains under the same conditions (compiled with XLA, or as a
TensorFlow graph with `--graph`; one repeated shuffled dataset; the same
seed). Training seconds count compilation and leave out the validation
passes. One seed answers for one run: `benchmarks/as_speed.py` runs
several.
"""

import argparse
import dataclasses
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
        "--validation-size",
        type=int,
        default=None,
        help="validation sentences (default 1000)",
    )
    parser.add_argument(
        "--test-size",
        type=int,
        default=None,
        help="test sentences (default: all, 2006 for WordNet)",
    )
    parser.add_argument(
        "--target",
        type=float,
        default=0.99,
        help="the fraction of softmax's best validation accuracy to reach",
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
        default=None,
        help="comma-separated names of as_softmax_lab.METHODS, each "
        "optionally with `/key=value` settings (default: softmax and "
        "as_softmax_lab.RECOMMENDED)",
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
        validation_size=32 if quick else 1000,
        test_size=32 if quick else None,
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

    if args.methods is None:
        args.methods = f"softmax,{lab.RECOMMENDED['multiclass']}"
    methods = args.methods.split(",")
    unknown = [m for m in methods if lab.parse_method(m)[0] not in lab.METHODS]
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
            "validation": args.validation_size,
            "test": args.test_size,
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
        name, settings, filter_options = lab.parse_method(method)
        print(
            f"[demo] training {method}: {lab.METHODS[name].description}",
            flush=True,
        )
        settings = {
            "learning_rate": args.learning_rate,
            "revisit": args.revisit,
            "epochs": args.epochs,
            **settings,
        }
        result = lab.run(
            name,
            prepared,
            backbone,
            seed=args.seed,
            batch_size=args.batch_size,
            evals_per_epoch=2,
            jit_compile=not args.graph,
            verbose=1,
            filter_options=filter_options,
            **settings,
        )
        result = dataclasses.replace(result, method=method)
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
    print(verdict(results, args.target))
    if args.json:
        write_json(results, args.json, args.target)
        print(f"[demo] figures written to {args.json}")
    print(f"[demo] wall time {time.perf_counter() - start:.0f}s")
    return 0


def _trained_fraction(result):
    fractions = result.trained_fraction
    return fractions[-1] if fractions else 1.0


def figures(results, target=0.99):
    """`{"methods": {name: {...}}}`: what the demo measured per method."""
    import as_softmax_lab as lab

    reached = {
        r["method"]: r for r in lab.time_to_target.records(results, target)
    }
    return {
        "methods": {
            r.method: {
                "val_metric": r.val_metric,
                "test_metric": r.test_metric,
                "train_seconds": r.train_time,
                "compile_seconds": r.compile_time,
                "seconds_to_target": reached.get(r.method, {}).get("seconds"),
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


def write_json(results, path, target=0.99):
    import json

    with open(path, "w") as f:
        json.dump(figures(results, target), f, indent=2)


def verdict(results, target=0.99):
    """Says plainly whether each method reached `target` of softmax's best
    validation metric sooner than softmax, and whether the recommended
    setting did."""
    import as_softmax_lab as lab

    if not any(r.method == "softmax" for r in results):
        return "[demo] no softmax run to compare with"
    lines = []
    recommended = lab.RECOMMENDED.get(results[0].task)
    answer = None
    runs = {r.method: r for r in results}
    for record in lab.time_to_target.records(results, target):
        r = runs[record["method"]]
        if r.method == "softmax":
            lines.append(
                f"[demo] target: {100 * record['target']:.2f} validation "
                f"{r.metric_name} ({target:g} of softmax's best); softmax "
                f"reached it in {record['seconds']:.0f}s"
            )
            continue
        sooner = record["reached"] and record["speedup"] > 1.0
        if r.method == recommended:
            answer = sooner
        reached = (
            f"reached it in {record['seconds']:.0f}s, "
            f"{record['speedup']:.2f}x softmax's speed to it"
            if record["reached"]
            else "never reached it"
        )
        drop = 100 * (record["softmax_test_metric"] - record["test_metric"])
        lines.append(
            f"[demo] {r.method}: {reached}; test {-drop:+.2f} points; "
            f"{100 * _last_epoch_masked(r):.0f}% masked in the last epoch, "
            f"trained on {100 * _trained_fraction(r):.0f}% of the drawn "
            "batches in it"
        )
    if answer is not None:
        lines.append(
            f"[demo] the recommended setting ({recommended}) reached "
            f"softmax's accuracy sooner: "
            + ("yes" if answer else "NO, not on this run")
            + " (one seed: benchmarks/RESULTS.md has five)"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
