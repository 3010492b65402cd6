"""The chain's seed (CHAINRUN_SEED): the framework helpers seed from it when they are imported,
unless the script seeded already; whatever the script seeds after the import wins. Each case
runs in a process of its own, as a training script does."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from ckpt_support import no_chainrun_env, restore_signal_handlers, script_env  # noqa: F401

# What a script that seeds nothing draws after importing the helper, and the sampler's seed.
DRAWS = """
import json, random, numpy, torch
from chainrun.checkpoint.torch import ResumableSampler
print(json.dumps([torch.initial_seed(), torch.rand(3).tolist(), random.random(), numpy.random.rand(),
                  ResumableSampler(10).seed]))
"""


def draws(code: str, **env: str) -> Any:
    """What ``code`` prints as JSON, run in a new interpreter with ``env`` added."""
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=script_env(**env), timeout=240
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(result.stdout.splitlines()[-1])


@pytest.mark.torch
def test_the_torch_helper_seeds_torch_numpy_and_random_from_the_chain_seed() -> None:
    """The same CHAINRUN_SEED draws the same numbers in every process (a segment, a rerun); another
    seed, another run; the sampler without a seed shuffles by the chain's seed too."""
    first, again = draws(DRAWS, CHAINRUN_SEED="123"), draws(DRAWS, CHAINRUN_SEED="123")
    other = draws(DRAWS, CHAINRUN_SEED="124")
    assert first == again
    assert first[0] == 123 and first[4] == 123
    assert all(a != b for a, b in zip(first, other))


@pytest.mark.torch
def test_a_script_that_seeds_itself_is_left_as_it_seeded() -> None:
    """Seeding before the import is not undone (the helper sees torch seeded and leaves all three);
    seeding after it wins, as any seeding after another does."""
    before = draws(
        "import json, random, torch\ntorch.manual_seed(5)\nrandom.seed(5)\n"
        "import chainrun.checkpoint.torch\n"
        "print(json.dumps([torch.initial_seed(), random.random()]))",
        CHAINRUN_SEED="123",
    )
    after = draws(
        "import json, random, torch\nimport chainrun.checkpoint.torch\ntorch.manual_seed(5)\n"
        "print(json.dumps([torch.initial_seed(), torch.rand(1).item()]))",
        CHAINRUN_SEED="123",
    )
    import random

    import torch

    assert before == [5, random.Random(5).random()]
    assert after == [5, torch.rand(1, generator=torch.Generator().manual_seed(5)).item()]


@pytest.mark.torch
def test_a_bad_chain_seed_warns_and_seeds_nothing() -> None:
    """A CHAINRUN_SEED set by hand ([env]) that NumPy would refuse is said, never a crash."""
    result = subprocess.run(
        [sys.executable, "-c", "import chainrun.checkpoint.torch"],
        capture_output=True,
        text=True,
        env=script_env(CHAINRUN_SEED=str(2**32)),
        timeout=240,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "CHAINRUN_SEED='4294967296' is not a whole number from 0 to 4294967295" in result.stderr


@pytest.mark.tensorflow
@pytest.mark.slow
def test_the_tensorflow_helper_sets_the_global_seed_from_the_chain_seed() -> None:
    """Importing the TensorFlow helper sets tf.random's global seed, Python's and NumPy's from
    CHAINRUN_SEED, unless the script set TensorFlow's global seed first."""
    pytest.importorskip("tensorflow")
    code = (
        "import json, random, numpy, tensorflow as tf\n{seed}import chainrun.checkpoint.tensorflow\n"
        "print(json.dumps([tf.compat.v1.get_seed(None)[0], tf.random.uniform([2]).numpy().tolist(),"
        " random.random(), numpy.random.rand()]))"
    )
    first = draws(code.format(seed=""), CHAINRUN_SEED="77", TF_CPP_MIN_LOG_LEVEL="3")
    again = draws(code.format(seed=""), CHAINRUN_SEED="77", TF_CPP_MIN_LOG_LEVEL="3")
    own = draws(code.format(seed="tf.random.set_seed(5)\n"), CHAINRUN_SEED="77", TF_CPP_MIN_LOG_LEVEL="3")
    assert first == again and first[0] == 77
    assert own[0] == 5
