"""PyTorch's own DCP tests on the stores (scripts/torch_dcp_suite.py): every test that passes on DCP's file
system passes on tenplex's stores. Skipped where PyTorch's test files or `expecttest` are absent
(tests/third_party/torch_dcp/README.md)."""

from __future__ import annotations

import importlib.util
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import torch_dcp_suite as suite  # noqa: E402

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("expecttest") is None, reason="expecttest is not installed")
]
copied = pytest.mark.skipif(
    not any(suite.TESTS.glob("test_*.py")), reason="PyTorch's DCP tests are not copied in"
)

# no-dist (and with DCP's ZStandard transform), the default storage from a checkpoint_id, conversion
# (planner_data), bytes over 2 ranks, the metadata's checkpoint id and save id
SUBSET = " or ".join(
    [
        "test_read_write_only_tensor_thread_count_1",
        "test_dcp_to_torch_save",
        "test_save_load_bytes_thread_count_1",
        "test_storage_meta",
    ]
)


def _check(keyword: str | None) -> None:
    with ThreadPoolExecutor(2) as pool:  # the two variants at once: each is a pytest process of its own
        fs, st = pool.map(lambda stores: suite.run(suite.TESTS, stores, keyword, 180), (False, True))
    res = suite.compare(fs, st)
    assert res["fs_passed"] > 0, fs
    assert res["lost"] == [], res


@pytest.mark.dist
@copied
def test_a_few_of_pytorchs_dcp_tests_pass_on_the_stores_as_on_the_file_system():
    _check(SUBSET)


@pytest.mark.slow
@pytest.mark.dist
@copied
def test_every_pytorch_dcp_test_the_file_system_passes_passes_on_the_stores():
    _check(None)


def test_tests_gated_on_gpus_are_known_before_their_ranks_spawn():
    from torch.testing._internal.common_distributed import skip_if_lt_x_gpu

    class Cases:
        @skip_if_lt_x_gpu(4)
        def test_four(self): ...

        @skip_if_lt_x_gpu(2, allow_cpu=True)
        def test_cpu_too(self): ...

        def test_plain(self): ...

    class Nccl(Cases):
        @property
        def backend(self):
            return "nccl"

    def item(cls, name):
        return type("Item", (), {"cls": cls, "obj": getattr(cls, name)})()

    assert suite._needs_gpus(item(Cases, "test_four")) == 4
    assert suite._needs_gpus(item(Cases, "test_cpu_too")) == 0
    assert suite._needs_gpus(item(Cases, "test_plain")) == 0
    assert suite._needs_gpus(item(Nccl, "test_plain")) == 1
