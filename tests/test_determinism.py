"""The same inputs give the same numbers in every process (engineering standard; reference/vector_math.py).

Each subprocess runs the fp32 reference's first layer over 600 tokens and prints a hash of its output.
Before the vector-math warm-up, ~1 process in 5 on 2 cores computed a different RoPE cos table (MKL's
lazy set-up raced between threads), so 10 processes catch that regression with probability ~0.9.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import hashlib, torch
from reference.config import TINY
from reference.layer import ReferenceLayer
from reference.model import ReferenceModel
from reference.weights.synthetic import SyntheticWeights
source = SyntheticWeights(TINY, seed=0)
ids = torch.randint(0, TINY.vocab_size, (600,), generator=torch.Generator().manual_seed(1))
model = ReferenceModel(source, torch.float32, "cpu")
class NoProbes:
    def wants(self, tap):
        return False
out = model.run_layer(ReferenceLayer(TINY, 0, source.layer(0), torch.float32), model.embed(ids), ids, [600], NoProbes())
print(hashlib.sha256(out.numpy().tobytes()).hexdigest())
"""


def test_first_layer_is_bit_identical_across_processes():
    hashes = set()
    for _ in range(10):
        done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        hashes.add(done.stdout.strip())
    assert len(hashes) == 1, f"{len(hashes)} different outputs from 10 identical processes"
