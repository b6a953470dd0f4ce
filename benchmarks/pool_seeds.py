"""Pools the per-seed accuracies and speed-ups of several `as_speed.py`
outputs.

`as_speed.py` prints one line per seed and method (`seed 3 softmax val
74.67 test 76.67 ...`). Runs of different seeds, made one after the other
or side by side on two cores, land in different files; this script reads
them all and prints, per method, the mean ± std of test and validation
accuracy over every seed it found, then, on the seeds a method shares with
the baseline, the mean per-seed difference, its 95% t-interval and how
many seeds ended lower and higher. A run of the same seed and method that
appears twice must agree exactly (a seed's run repeats exactly on one CPU,
as `results/as_speed_hybrid_lr_torch.txt` shows on PyTorch); otherwise the
script stops, so that outputs of code that trains differently are not
pooled by mistake.

Usage:

```
cd benchmarks/results
python ../pool_seeds.py as_speed_as_softmax_torch.txt \
    as_speed_more_seeds_torch.txt
python ../pool_seeds.py FILE... --baseline softmax --methods as_softmax
```

Times are not pooled: a speed-up is a ratio of times measured side by
side in one run. Per seed, the script divides the baseline's seconds per
epoch by the method's, both read from the one output holding that seed's
pair, then the same for whole runs (the epochs' seconds and compilation's
together, as `as_speed.py`'s `+compile ratio`), and prints the mean of
those ratios with the seeds' own.
"""

import argparse
import math
import re
import statistics
import sys

# Plain Python on purpose: as_softmax_lab.report formats tables alike, but
# importing the lab loads Keras and TensorFlow (20 s) for a text script.

LINE = re.compile(
    r"^seed (?P<seed>\d+) (?P<method>\S+)\s+val\s+(?P<val>[\d.]+) "
    r"test\s+(?P<test>[\d.]+)"
)
SECONDS = re.compile(
    r"\s(?P<epoch>[\d.]+)s/epoch(?: compile\s+(?P<compile>[\d.]+)s)?"
    r"(?:.*? s/epoch \[(?P<epochs>[\d., ]+)\])?"
)
# Two-sided 95% quantiles of Student's t, by degrees of freedom.
T_975 = {
    1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365,
    8: 2.306, 9: 2.262, 10: 2.228, 11: 2.201, 12: 2.179, 13: 2.160,
    14: 2.145, 15: 2.131, 16: 2.120, 17: 2.110, 18: 2.101, 19: 2.093,
    20: 2.086,
}  # fmt: skip


def read_runs(paths, tags, baseline):
    """Returns `({method: {seed: (val, test)}}, seconds)` from `as_speed.py`
    outputs; `seconds[(path, method, seed)]` is `(seconds per epoch, whole
    run's seconds or None)`.

    `tags` maps an output's path to a name appended to its methods (the
    baseline's excepted), for a setting that the names do not show.
    """
    runs, origin, seconds = {}, {}, {}
    for path in paths:
        with open(path, encoding="utf-8") as file:
            for line in file:
                match = LINE.match(line)
                if not match:
                    continue
                method = match["method"]
                if path in tags and method != baseline:
                    method += f" [{tags[path]}]"
                key = (method, int(match["seed"]))
                value = (float(match["val"]), float(match["test"]))
                known = runs.setdefault(key[0], {}).get(key[1])
                if known is not None and known != value:
                    sys.exit(
                        f"seed {key[1]} of {key[0]}: {origin[key]} has "
                        f"val/test {known}, {path} has {value}; pooling "
                        "needs one result per seed and method"
                    )
                runs[key[0]][key[1]] = value
                origin.setdefault(key, path)
                timed = run_seconds(line, match.end())
                if timed:
                    seconds[(path, *key)] = timed
    if not runs:
        sys.exit(f"no `seed N method val X test Y` lines in {', '.join(paths)}")
    return runs, seconds


def run_seconds(line, start):
    """`(seconds per epoch, whole run's seconds or None)` of an output's
    line, read from `start`; None if it shows no times."""
    timed = SECONDS.search(line, start)
    if not timed:
        return None
    if not (timed["compile"] and timed["epochs"]):
        return float(timed["epoch"]), None
    epochs = map(float, timed["epochs"].split(","))
    return float(timed["epoch"]), sum(epochs) + float(timed["compile"])


def speedups(seconds, method, baseline):
    """Per seed, the baseline's seconds over the method's from the output
    that holds both: `{seed: (per epoch, whole run or None)}`."""
    ratios = {}
    for (path, name, seed), (epoch, whole) in seconds.items():
        base = seconds.get((path, baseline, seed))
        if name != method or base is None:
            continue
        both = whole is not None and base[1] is not None
        ratios[seed] = (base[0] / epoch, base[1] / whole if both else None)
    return ratios


def speedup_cells(ratios):
    """`1.86x (1.85/1.82/1.90)`-style cells, per epoch and whole run."""
    cells = []
    for i in range(2):
        values = [ratios[s][i] for s in sorted(ratios)]
        if not values or None in values:
            cells.append("-")
            continue
        each = "/".join(f"{v:.2f}" for v in values)
        cells.append(f"{statistics.mean(values):.2f}x ({each})")
    return cells


def mean_std(values):
    if len(values) < 2:
        return f"{values[0]:.2f}"
    return f"{statistics.mean(values):.2f} ± {statistics.stdev(values):.2f}"


def paired(differences):
    """Mean difference, its 95% t-interval, and seeds lower / higher."""
    n = len(differences)
    mean = statistics.mean(differences)
    lower = sum(d < 0 for d in differences)
    higher = sum(d > 0 for d in differences)
    if n < 2:
        return f"{mean:+.2f}", f"{lower}/{higher}"
    half = T_975[min(n - 1, max(T_975))] * statistics.stdev(differences)
    half /= math.sqrt(n)
    return (
        f"{mean:+.2f} [{mean - half:+.2f}, {mean + half:+.2f}]",
        f"{lower}/{higher}",
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", nargs="+", help="as_speed.py outputs")
    parser.add_argument("--baseline", default="softmax")
    parser.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="OUTPUT=NAME",
        help="report that output's methods as `method [NAME]`: runs made "
        "with a setting their names do not show (`--warmup-ratio`)",
    )
    parser.add_argument(
        "--methods", default=None, help="comma-separated; default: all found"
    )
    args = parser.parse_args(argv)
    tags = dict(tag.split("=", 1) for tag in args.tag)
    unknown = set(tags) - set(args.outputs)
    if unknown:
        sys.exit(
            f"--tag names {', '.join(sorted(unknown))}, not an output given"
        )
    runs, seconds = read_runs(args.outputs, tags, args.baseline)
    if args.baseline not in runs:
        sys.exit(f"no {args.baseline!r} runs; found {', '.join(sorted(runs))}")
    methods = args.methods.split(",") if args.methods else sorted(runs)
    missing = [m for m in methods if m not in runs]
    if missing:
        sys.exit(
            f"no runs of {', '.join(missing)}; found {', '.join(sorted(runs))}"
        )
    base = runs[args.baseline]
    table = [
        [
            "method", "seeds", "test", "validation", "paired seeds",
            f"test - {args.baseline} [95%]", "lower/higher",
            f"validation - {args.baseline} [95%]", "lower/higher",
            "speed-up (seeds)", "with compilation",
        ]
    ]  # fmt: skip
    for method in [args.baseline] + [m for m in methods if m != args.baseline]:
        seeds = sorted(runs[method])
        val = [runs[method][s][0] for s in seeds]
        test = [runs[method][s][1] for s in seeds]
        row = [method, ",".join(map(str, seeds)), mean_std(test), mean_std(val)]
        shared = [s for s in seeds if s in base]
        if method != args.baseline and shared:
            row.append(",".join(map(str, shared)))
            row.extend(
                paired([runs[method][s][1] - base[s][1] for s in shared])
            )
            row.extend(
                paired([runs[method][s][0] - base[s][0] for s in shared])
            )
            row.extend(speedup_cells(speedups(seconds, method, args.baseline)))
        table.append(row)
    widths = [
        max(len(row[i]) for row in table if i < len(row))
        for i in range(len(table[0]))
    ]
    for row in table:
        cells = [row[0].ljust(widths[0])]
        cells += [cell.rjust(width) for cell, width in zip(row[1:], widths[1:])]
        print("  ".join(cells).rstrip())
    print(
        f"\nmean ± std over seeds; differences per seed against "
        f"{args.baseline} (same seed, same data order), their mean with a 95% "
        "t-interval; lower/higher: seeds below / above it; speed-up: "
        f"{args.baseline}'s seconds per epoch over the method's, per seed "
        "from the output holding both, their mean and the seeds' own; with "
        "compilation: the same of whole runs."
    )


if __name__ == "__main__":
    main()
