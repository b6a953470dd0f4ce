# Sourced by the test scripts: the suites' test files, and pytest's
# common arguments. The tests run in parallel, one pytest-xdist worker per
# core up to four (PYTEST_WORKERS sets the number; 0 runs them in this
# process). Every test seeds itself (conftest.py), so the order they land
# in does not matter.
training_tests=(tests/test_as_speed.py tests/test_filters.py tests/test_accumulation.py)
loss_tests=(tests/test_losses.py tests/test_as_speed_backends.py)
cores="$(nproc 2>/dev/null || echo 1)"
pytest_args=(-q -p no:cacheprovider -n "${PYTEST_WORKERS:-$((cores < 4 ? cores : 4))}")
