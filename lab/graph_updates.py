"""Investigation (issue 30): how often XLA re-records a step's CUDA graph.

XLA's GPU runtime runs a step as a command buffer (a CUDA graph). Before
each execution it compares the addresses of the buffers the graph's
commands use with those it recorded; when any moved (a fresh input batch,
a new output, a temporary buffer elsewhere), it updates, on the host, each
command that uses one of them (`command_buffer_thunk.cc`,
`command_executor.cc`). A conditional is one command that holds both
branches: updating it updates the commands of each branch that use a
moved buffer, whichever branch will run.

This reads the runtime's log of a run taken with `TF_CPP_MIN_LOG_LEVEL=0`
and `TF_CPP_VMODULE` naming those modules (as `lab/device_checks.sh`'s
graph_updates step does) and prints, per command buffer (told apart by its
number of top-level commands): its updates, the executions between them,
the buffer allocations that had moved and the host time an update took;
then the nested command sequences that were updated, with how many of
their commands were. Timings under a log this verbose compare within the
run only.

    python lab/graph_updates.py LOG
"""

import argparse
import collections
import pathlib
import re
import statistics

# Lines of XLA's GPU runtime (VLOG), tolerant of the fields that older
# jaxlibs leave out.
UPDATE = re.compile(
    r"Update command buffer on device #\d+ .*?after (\d+) executions since "
    r"last update(?:; num_commands=(\d+))?(?:; updated_allocs=(\d+))?"
)
MICROS = r"(\d+) (?:μs|µs|us)"
UPDATED = re.compile(r"Updated command buffer in " + MICROS)
EXECUTE = re.compile(r"Execute command buffer on device #\d+")
SEQUENCE = re.compile(
    r"Updated (\d+) commands in "
    + MICROS
    + r" \(skipped (\d+) command updates\)"
)


def parse(lines):
    """`(executions, buffers, sequences)`: executions is the count of
    command buffer executions; buffers maps a command buffer's top-level
    command count (None where the log does not say) to its updates as
    `(executions since the last, moved allocations or None, µs or None)`;
    sequences maps a re-recorded command sequence's size to
    `(commands updated, µs)` per re-recording."""
    executions = 0
    buffers = collections.defaultdict(list)
    sequences = collections.defaultdict(list)
    pending = None  # an update whose time follows on a later line
    for line in lines:
        if EXECUTE.search(line):
            executions += 1
        elif match := UPDATE.search(line):
            since, commands, moved = match.groups()
            commands = None if commands is None else int(commands)
            moved = None if moved is None else int(moved)
            pending = [int(since), moved, None]
            buffers[commands].append(pending)
        elif match := UPDATED.search(line):
            if pending is not None:
                pending[2] = int(match.group(1))
                pending = None
        elif match := SEQUENCE.search(line):
            size, micros, skipped = map(int, match.groups())
            sequences[size].append((size - skipped, micros))
    return executions, buffers, sequences


def _median(values):
    values = [v for v in values if v is not None]
    return f"{statistics.median(values):g}" if values else "-"


def _most(item):
    return -len(item[1])


def report(executions, buffers, sequences):
    updates = sum(len(u) for u in buffers.values())
    if not executions and not updates:
        print(
            "no command buffer lines: was the log taken with the "
            "TF_CPP_VMODULE above, on a GPU?"
        )
        return
    # jaxlib 0.11.2's plugin logs no update times: say so, not "0.0 ms".
    times = [m for u in buffers.values() for _, _, m in u if m is not None]
    host = f"{sum(times) / 1e3:.1f} ms" if times else "time not logged"
    print(
        f"{executions} command buffer executions, {updates} updates "
        f"({host} on the host in all)"
    )
    print("commands  updates  executions/update  moved allocations  update µs")
    for commands, entries in sorted(buffers.items(), key=_most):
        since, moved, micros = zip(*entries)
        name = "?" if commands is None else commands
        print(
            f"{name:>8}  {len(entries):7d}  {_median(since):>17}  "
            f"{_median(moved):>17}  {_median(micros):>9}"
        )
    if sequences:
        print(
            "re-recorded sequences: size, times, commands updated, µs (medians)"
        )
        for size, entries in sorted(sequences.items(), key=_most):
            updated, micros = zip(*entries)
            print(
                f"{size:>8}  {len(entries):7d}  {_median(updated):>8}  "
                f"{_median(micros):>8}"
            )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("log", type=pathlib.Path)
    args = parser.parse_args(argv)
    with open(args.log, errors="replace") as f:
        report(*parse(f))


if __name__ == "__main__":
    main()
