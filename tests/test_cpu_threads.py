"""The CPU executor's thread pool (src/cpp/threadpool.h): which loops it splits, and that
the thread count never changes a result.

Structural, not timed: a loop below two chunks' worth of work must run inline on the
calling thread and hand nothing to the workers; a larger one is cut into chunks that
cover it exactly once. Every output is computed whole by one thread, so logits and
tokens are bit-identical at any thread count.
"""

import os
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import lily
from lily import _lily
from lily._lily import ops
from reference import numpy_ops as ref

MIN_WORK = ops.min_chunk_work


@pytest.fixture
def threads():
    """Sets the thread count for a test, then restores it."""
    before = _lily.num_threads()
    yield _lily.set_num_threads
    _lily.set_num_threads(before)


@pytest.fixture(scope="module")
def lily_tiny():
    return lily.Model.load("lily-tiny", device="cpu")


def test_a_loop_below_two_chunks_of_work_runs_inline(threads):
    threads(4)
    jobs = ops.parallel_jobs()
    for n, item_work in [(1, 10**9), (10, 100), (64, (2 * MIN_WORK - 1) // 64)]:
        assert ops.parallel_chunks(n, item_work) == 1
        assert ops.parallel_ranges(n, item_work) == [(0, n, True)]
    assert ops.parallel_jobs() == jobs


def test_a_large_loop_is_cut_into_chunks_that_cover_it_once(threads):
    threads(3)
    assert ops.parallel_chunks(64, 2 * MIN_WORK // 64) == 2  # exactly two chunks' worth
    n, item_work = 1000, MIN_WORK // 8
    chunks = ops.parallel_chunks(n, item_work)
    assert chunks > 3
    jobs = ops.parallel_jobs()
    ranges = ops.parallel_ranges(n, item_work)
    assert ops.parallel_jobs() == jobs + 1
    assert len(ranges) == chunks
    assert [r[0] for r in ranges] == [0] + [r[1] for r in ranges[:-1]] and ranges[-1][1] == n


def test_one_thread_never_splits(threads):
    threads(1)
    assert ops.parallel_chunks(10**6, 10**6) == 1
    assert ops.parallel_ranges(1000, MIN_WORK) == [(0, 1000, True)]


def test_decode_sized_ops_of_lily_tiny_run_inline(threads, lily_tiny):
    """A decode step's matmuls (one token through 64-512 rows of 256) are far below a chunk."""
    threads(2)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((1, 256)).astype(np.float32)
    jobs = ops.parallel_jobs()
    for rows in (16, 64, 256, 512):
        ops.qmatmul(x, ref.random_qweight(rng, rows, 256))
    ops.rmsnorm(x, np.ones(256, np.float32), 1e-6)
    assert ops.parallel_jobs() == jobs
    # Prefill-sized calls of the same ops are split.
    ops.qmatmul(rng.standard_normal((256, 256)).astype(np.float32), ref.random_qweight(rng, 512, 256))
    assert ops.parallel_jobs() > jobs


def test_a_one_token_moe_block_is_two_loops_of_all_its_experts(threads):
    """Each expert's product alone is below a split; a MoE block runs the gate and up
    products of all its experts (routed and shared) as one loop, the down products as
    another, so together they are split."""
    threads(2)
    rng = np.random.default_rng(2)
    H, E, I = 1024, 16, 256
    w = {
        "router": ref.random_qweight(rng, E, H, bits=8, spread=4.0),
        "gate_proj": ref.random_qweight(rng, I, H, experts=E),
        "up_proj": ref.random_qweight(rng, I, H, experts=E),
        "down_proj": ref.random_qweight(rng, H, I, experts=E),
        "shared_gate_proj": ref.random_qweight(rng, I, H),
        "shared_up_proj": ref.random_qweight(rng, I, H),
        "shared_down_proj": ref.random_qweight(rng, H, I),
        "shared_expert_gate": ref.random_qweight(rng, 1, H, bits=8),
    }
    x = rng.standard_normal((1, H)).astype(np.float32)
    # One token through one expert: 16-row blocks of 2 * 16 * K units each (qmatmul.cpp).
    assert ops.parallel_chunks(I // 16, 2 * 16 * H) == 1 and ops.parallel_chunks(H // 16, 2 * 16 * I) == 1
    jobs = ops.parallel_jobs()
    y = ops.moe_block(x, w, 4, True)
    assert ops.parallel_jobs() == jobs + 2
    threads(1)
    np.testing.assert_array_equal(ops.moe_block(x, w, 4, True), y)


def test_qmatmul_is_bit_identical_at_every_thread_count(threads):
    rng = np.random.default_rng(1)
    w = ref.random_qweight(rng, 1000, 512)
    x = rng.standard_normal((40, 512)).astype(np.float32)
    out = {}
    for n in (1, 2, 3, 5):
        threads(n)
        jobs = ops.parallel_jobs()
        out[n] = ops.qmatmul(x, w)
        assert ops.parallel_jobs() == jobs + (n > 1)  # really split
    for n in (2, 3, 5):
        np.testing.assert_array_equal(out[n], out[1])


def test_lily_tiny_logits_and_tokens_are_identical_at_every_thread_count(threads, lily_tiny):
    ids = lily_tiny.encode("def read_config(path):\n    with open(path) as f:\n        return json.load(f)\n" * 12)
    runs = {}
    for n in (1, 2, 3):
        threads(n)
        jobs = ops.parallel_jobs()
        logits = lily_tiny.logits(ids)
        assert n == 1 or ops.parallel_jobs() > jobs  # the prompt's ops were split
        tokens = lily_tiny.generate(ids, max_tokens=24, ignore_eos=True).token_ids
        runs[n] = (logits, tokens)
    for n in (2, 3):
        np.testing.assert_array_equal(runs[n][0], runs[1][0])
        assert runs[n][1] == runs[1][1]


def test_two_engines_forwarding_at_once_match_one_at_a_time(threads, lily_tiny):
    """The second caller runs its loops inline while the first holds the pool."""
    threads(2)
    other = lily.Model.load("lily-tiny", device="cpu")
    ids = lily_tiny.encode("import os\n" * 60)
    want = lily_tiny.logits(ids)
    got = [None, None]

    def run(i, model):
        got[i] = model.logits(ids)

    workers = [threading.Thread(target=run, args=(i, m)) for i, m in enumerate((lily_tiny, other))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for g in got:
        np.testing.assert_array_equal(g, want)


def test_resizing_the_pool_between_loops_is_safe():
    """A worker started by set_num_threads must not rejoin a loop that already finished
    (it did, and called a dead function: a segfault). In a subprocess, so a crash fails
    this test instead of the whole run."""
    code = (
        "import numpy as np\n"
        "from lily._lily import ops, set_num_threads\n"
        "from reference import numpy_ops as ref\n"
        "rng = np.random.default_rng(0)\n"
        "w, x = ref.random_qweight(rng, 512, 256), rng.standard_normal((64, 256)).astype(np.float32)\n"
        "want = ops.qmatmul(x, w)\n"
        "for n in (1, 2, 1, 3, 2, 2):\n"
        "    set_num_threads(n)\n"
        "    assert np.array_equal(ops.qmatmul(x, w), want), n\n"
        "print('ok')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parent)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (done.returncode, done.stderr)


def test_a_bad_thread_count_is_refused_by_name(threads):
    with pytest.raises(lily.LilyError, match="thread count must be from 1 to 1024, got 0"):
        threads(0)
    assert _lily.num_threads() >= 1  # the pool is left as it was


@pytest.mark.parametrize("value", ["abc", "0", "-2", "4x", "100000"])
def test_a_bad_LILY_NUM_THREADS_is_an_error_naming_it(value):
    code = "from lily import _lily\nprint(_lily.num_threads())\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LILY_NUM_THREADS": value})
    assert done.returncode != 0
    assert f"LILY_NUM_THREADS must be a whole number from 1 to 1024, got '{value}'" in done.stderr


def test_LILY_NUM_THREADS_sets_the_default():
    code = "from lily import _lily\nprint(_lily.num_threads())\n"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "LILY_NUM_THREADS": "3"})
    assert done.stdout.strip() == "3", done.stderr
