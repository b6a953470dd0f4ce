# Sourced by the test scripts: the suites' test files, and pytest's
# common arguments. The tests run in parallel, one pytest-xdist worker per
# core up to four (PYTEST_WORKERS sets the number; 0 runs them in this
# process). Every test seeds itself (conftest.py), so the order they land
# in does not matter.
training_tests=(tests/test_as_speed.py tests/test_filters.py tests/test_accumulation.py)
loss_tests=(tests/test_losses.py tests/test_as_speed_backends.py)
# The training suite's core, a `-k` expression over training_tests: for the
# runs that check the package against another release of a dependency (the
# jax that Python 3.11 gets, Keras's next release), where the whole suite
# already runs on the releases users install. The trainer (fit, evaluate,
# saving, resuming, distribution), the accumulation window, and the
# filtered step's invariants: no host read, the same weights every time,
# steps per execution in one scan. (keras-hub's tasks train in the full runs.)
core_training="(test_as_speed.py or test_accumulation.py or steps_per_execution"
core_training+=" or lax_scan or same_weights or reads_no_device) and not keras_hub"
cores="$(nproc 2>/dev/null || echo 1)"
pytest_args=(-q -p no:cacheprovider -n "${PYTEST_WORKERS:-$((cores < 4 ? cores : 4))}")
