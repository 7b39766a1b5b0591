import os

import numpy as np
import pytest


@pytest.fixture
def rng():
    """Fresh random inputs each run; the seed is printed so a failure can be replayed
    (FLASHCPP_TEST_SEED=<seed> pins it)."""
    seed = int(os.environ.get("FLASHCPP_TEST_SEED", int.from_bytes(os.urandom(4), "little")))
    print(f"seed={seed}")
    return np.random.default_rng(seed)
