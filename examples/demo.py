"""Softmax vs AS-Softmax vs AS-Speed in one command.

Fine-tunes the offline all-MiniLM-L6-v2 (KerasHub `BertBackbone`) on the
bundled WordNet lexicographer-category data (45 classes, real text, no
network) with each method, prints a comparison table and writes three
plots to `--output-dir`:

* `masked_ratio.png`: masked samples per training step (paper Fig. 1);
* `loss_vs_accuracy.png`: validation loss vs accuracy, Pearson r (Table 4);
* `margins.png`: test-set `p_target - max p_other` histogram (Fig. 4).

Usage:

```
python examples/demo.py                     # ~9 minutes on 2 idle CPU cores
python examples/demo.py --quick             # smoke test, about a minute
python examples/demo.py --source clinc_oos  # needs tensorflow-datasets, network
```
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
        "--epochs", type=int, default=None, help="epochs per method (default 2)"
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
        "--preset", default="offline-minilm", help="KerasHub BERT preset"
    )
    parser.add_argument(
        "--source", default="wordnet", choices=("wordnet", "clinc_oos")
    )
    parser.add_argument("--methods", default="softmax,as_softmax,as_speed")
    parser.add_argument("--output-dir", default="demo_outputs")
    args = parser.parse_args(argv)
    quick = args.quick
    defaults = dict(
        epochs=1 if quick else 2,
        train_size=64 if quick else 1024,
        eval_size=32 if quick else 300,
        sequence_length=24 if quick else 32,
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if quick:
        args.batch_size = min(args.batch_size, 16)
    return args


def main(argv=None):
    args = parse_args(argv)
    start = time.perf_counter()
    import as_softmax_lab as lab
    from as_softmax_lab import datasets

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
    for method in args.methods.split(","):
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
    print(f"[demo] wall time {time.perf_counter() - start:.0f}s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
