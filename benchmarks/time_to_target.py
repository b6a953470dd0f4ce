"""The time-to-target table and plots from `results/time_to_target.json`.

`benchmarks/as_speed.py` merges one record per backend, task, method and
seed into that file. This script prints the Markdown table that opens
`benchmarks/RESULTS.md` (per backend, task and method: seeds that reached
99% of softmax's best validation metric, the median speed-up to it, a
seed not reached counting 0x, and the mean test difference from softmax
with its 95% interval), and draws, per backend and task, validation
metric against training seconds for softmax and the recommended setting
(`as_softmax_lab.RECOMMENDED`), one line per seed.

Usage:

```
python benchmarks/time_to_target.py
python benchmarks/time_to_target.py --records other.json --plots /tmp
```
"""

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--records", default=os.path.join(RESULTS, "time_to_target.json")
    )
    parser.add_argument(
        "--plots", default=RESULTS, help="folder of the PNG files"
    )
    args = parser.parse_args(argv)
    from as_softmax_lab import RECOMMENDED
    from as_softmax_lab import plot_time_to_target
    from as_softmax_lab import time_to_target

    with open(args.records) as f:
        records = json.load(f)
    print(time_to_target.table(records))
    print(
        "\nepoch starts: the seconds from an epoch's start to its first "
        "evaluation over the epoch's other intervals (2 evaluations an "
        "epoch), per backend and method, median and max over epochs and "
        "seeds; 2x would be a stall that an evaluation leaves behind"
    )
    groups = {}
    for r in records:
        key = (r["backend"], r["task"], r["method"])
        groups.setdefault(key, []).extend(time_to_target.epoch_start_ratios(r))
    for (backend, task, method), ratios in sorted(groups.items()):
        if ratios:
            print(
                f"{backend}, {task}, {method}: median "
                f"x{statistics.median(ratios):.2f}, max x{max(ratios):.2f}"
            )
    groups = sorted({(r["backend"], r["task"]) for r in records})
    for backend, task in groups:
        group = [
            r for r in records if (r["backend"], r["task"]) == (backend, task)
        ]
        name = f"time_to_target_{backend.split()[0]}_{task}.png"
        path = os.path.join(args.plots, name)
        plot_time_to_target(group, ["softmax", RECOMMENDED[task]], path)
        print(f"{backend}, {task}: {os.path.relpath(path, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
