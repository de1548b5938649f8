import os
import sys
import threading

# Automodel's activations are torch.compile'd; on the CPU that compiles C++ for every shape. Eager
# execution computes the same values, in a fraction of the test time.
os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")

import pytest  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))


def run_ranks(R, fn):
    """Runs fn(rank) on R threads (the host backend's simulated ranks meet inside the library, which
    releases the GIL) and returns the results in rank order; re-raises the first failure."""
    results, errors = [None] * R, [None] * R

    def body(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors[r] = e

    threads = [threading.Thread(target=body, args=(r,)) for r in range(R)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for e in errors:
        if e is not None:
            raise e
    return results


@pytest.fixture
def ranks():
    return run_ranks
