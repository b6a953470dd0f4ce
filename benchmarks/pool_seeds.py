"""Pools the per-seed lines of several `benchmarks/as_speed.py` outputs.

Each output holds one line per seed and method (`seed 3 as_skip val ...
test ... s/epoch [...] compile ...`). This prints, per method, the test
and validation accuracy over every seed of every file (mean ± std, the
std over seeds as `as_speed.py` reports it), each seed's test difference
to softmax of the same seed, and the speed-ups measured side by side:
within each file, softmax's training seconds over the method's, without
and with compilation counted (the `epoch ratio` and `+compile ratio` of
`as_speed.py`, inverted). Files that ran the same seed twice keep the
first.

```
cd benchmarks/results
python ../pool_seeds.py as_speed_bf16_scoring_jax.txt as_speed_seeds_3_5_jax.txt
```
"""

import argparse
import re

import numpy as np

LINE = re.compile(
    r"^seed (?P<seed>\d+) (?P<method>\S+)\s+val\s+(?P<val>[\d.]+) "
    r"test\s+(?P<test>[\d.]+)\s.*?compile\s+(?P<compile>[\d.]+)s .*?"
    r" s/epoch \[(?P<epochs>[^\]]*)\]"
)


def read(path):
    """`{(method, seed): run}` of one output, a run's times in seconds."""
    runs = {}
    with open(path) as f:
        for line in f:
            match = LINE.match(line)
            if match is None:
                continue
            epochs = [float(t) for t in match["epochs"].split(",")]
            runs[match["method"], int(match["seed"])] = {
                "val": float(match["val"]),
                "test": float(match["test"]),
                "train": sum(epochs),
                "compile": float(match["compile"]),
            }
    return runs


def speedups(runs, method):
    """Softmax's training seconds over `method`'s in one output, without
    and with compilation counted, over the seeds both ran."""
    seeds = [s for m, s in runs if m == method and ("softmax", s) in runs]
    if not seeds:
        return None

    def total(name, compile_counted):
        return sum(
            runs[name, s]["train"]
            + (runs[name, s]["compile"] if compile_counted else 0.0)
            for s in seeds
        )

    return tuple(
        total("softmax", counted) / total(method, counted)
        for counted in (False, True)
    )


def stats(values):
    return f"{np.mean(values):6.2f} ± {np.std(values, ddof=1):4.2f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outputs", nargs="+")
    args = parser.parse_args()
    outputs = [(path, read(path)) for path in args.outputs]
    pooled = {}
    for _, runs in outputs:
        for key, run in runs.items():
            pooled.setdefault(key, run)
    methods = list(dict.fromkeys(m for m, _ in pooled))
    print(
        f"{'method':34s} seeds  test           val            "
        "test - softmax per seed"
    )
    for method in methods:
        seeds = sorted(s for m, s in pooled if m == method)
        test = [pooled[method, s]["test"] for s in seeds]
        val = [pooled[method, s]["val"] for s in seeds]
        diffs = [
            f"{pooled[method, s]['test'] - pooled['softmax', s]['test']:+.2f}"
            for s in seeds
            if ("softmax", s) in pooled
        ]
        print(
            f"{method:34s} {len(seeds):5d}  {stats(test)}  {stats(val)}  "
            f"{', '.join(diffs)}"
        )
    print("\nspeed-up against softmax, side by side in each output:")
    for path, runs in outputs:
        for method in dict.fromkeys(m for m, _ in runs):
            ratios = speedups(runs, method)
            if method != "softmax" and ratios is not None:
                print(
                    f"  {path}: {method}: {ratios[0]:.2f}x, "
                    f"{ratios[1]:.2f}x with compilation counted"
                )


if __name__ == "__main__":
    main()
