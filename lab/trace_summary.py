"""Investigation (issue 30): where a filtered step's time goes on a GPU.

Reads the Perfetto traces `benchmarks/gpu_check.py --trace DIR` writes
(`jax.profiler`, one per variant) and prints, per variant and per track
(a host thread, a device stream, XLA's module and op lines): its events,
their summed and their overlapping-merged ("busy") time, the span from
first start to last end, and the longest gaps between events. Then the
names that took the most time on that track, and the events whose name
says they copy between device and host or wait for the device, which is
what a conditional costs on XLA's GPU runtime when it reads its
predicate back.

A trace's tracks and names depend on the platform and on the jaxlib that
wrote it, so nothing here assumes a GPU's: on the CPU the same script
shows the host threads that run XLA's thunks.

    python lab/trace_summary.py DIR            # DIR as given to --trace
    python lab/trace_summary.py DIR --top 15 --tracks 12
"""

import argparse
import collections
import gzip
import json
import pathlib
import re

TRANSFER = re.compile(r"memcpy|dtoh|d2h|devicetohost|blockhost|synchron", re.I)


def load(path):
    with gzip.open(path, "rt") as f:
        trace = json.load(f)
    return trace["traceEvents"] if isinstance(trace, dict) else trace


def tracks(events):
    """`{(process name, thread name): [(start, end, name)]}`, in µs."""
    names = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") in (
            "process_name",
            "thread_name",
        ):
            key = (e["pid"], e.get("tid"))
            names[key] = e["args"]["name"]
    out = collections.defaultdict(list)
    for e in events:
        if e.get("ph") != "X":
            continue
        start = float(e["ts"])
        end = start + float(e.get("dur", 0.0))
        track = (
            names.get((e["pid"], None), str(e["pid"])),
            names.get((e["pid"], e.get("tid")), str(e.get("tid"))),
        )
        out[track].append((start, end, e["name"]))
    return out


def busy_and_gaps(spans):
    """Merged busy time and the gaps between merged intervals."""
    busy, gaps = 0.0, []
    current_start = current_end = None
    for start, end, _ in sorted(spans):
        if current_end is None:
            current_start, current_end = start, end
        elif start > current_end:
            busy += current_end - current_start
            gaps.append(start - current_end)
            current_start, current_end = start, end
        else:
            current_end = max(current_end, end)
    if current_end is not None:
        busy += current_end - current_start
    return busy, gaps


def summarize(path, top, max_tracks):
    per_track = tracks(load(path))
    ranked = sorted(
        per_track.items(),
        key=lambda item: -sum(end - start for start, end, _ in item[1]),
    )
    for (process, thread), spans in ranked[:max_tracks]:
        busy, gaps = busy_and_gaps(spans)
        span = max(e for _, e, _ in spans) - min(s for s, _, _ in spans)
        total = sum(end - start for start, end, _ in spans)
        longest = ", ".join(f"{g:.0f}" for g in sorted(gaps)[-3:][::-1])
        print(
            f"  [{process} / {thread}] {len(spans)} events, "
            f"summed {total / 1e3:.2f} ms, busy {busy / 1e3:.2f} ms "
            f"of a {span / 1e3:.2f} ms span; longest gaps (µs): {longest}"
        )
        by_name = collections.Counter()
        count = collections.Counter()
        for start, end, name in spans:
            by_name[name] += end - start
            count[name] += 1
        for name, micros in by_name.most_common(top):
            print(
                f"      {micros / 1e3:9.3f} ms {count[name]:6d}x  {name[:90]}"
            )
        transfers = {n: count[n] for n in count if TRANSFER.search(n)}
        if transfers:
            listed = ", ".join(f"{n[:50]} {c}x" for n, c in transfers.items())
            print(f"      copies/waits: {listed}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=pathlib.Path)
    parser.add_argument("--top", type=int, default=8, help="names per track")
    parser.add_argument("--tracks", type=int, default=8, help="per trace")
    args = parser.parse_args(argv)
    paths = sorted(args.directory.rglob("perfetto_trace.json.gz"))
    if not paths:
        parser.error(f"no perfetto_trace.json.gz under {args.directory}")
    for path in paths:
        # DIR/<shape>/<variant>/plugins/profile/<run>/perfetto_trace.json.gz
        variant = path.relative_to(args.directory).parts[:-4]
        print(f"== {'/'.join(variant) or path}")
        summarize(path, args.top, args.tracks)


if __name__ == "__main__":
    main()
