"""Dataset views in the store: a rank's samples, listed by `ElasticSampler` and read from the corpus map."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tenplex.cli.main import main as cli_main
from tenplex.data import Corpus, ElasticSampler, TokenWindows, build_corpus
from tenplex.store import BadRequestError, NotFoundError, StoreClient, start_store

pytestmark = pytest.mark.timeout(120)

SEQ = 16
GB = 12


def write_texts(folder, sizes: list[int], seed: int = 0) -> None:
    """Text files of printable bytes (never NUL, the corpus's document separator)."""
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    for i, n in enumerate(sizes):
        (folder / f"doc{i}.txt").write_bytes(rng.integers(32, 127, size=n, dtype=np.uint8).tobytes())


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Corpus:
    root = tmp_path_factory.mktemp("corpus")
    write_texts(root / "src", [3000, 5000, 1234, 7777])
    return build_corpus([root / "src"], root=root / "built", heldout=0.0)


@pytest.fixture(scope="module")
def store():
    sp = start_store(memory_limit="256MiB")
    yield sp
    assert sp.stop() == 0


@pytest.fixture(scope="module")
def windows(corpus) -> TokenWindows:
    return TokenWindows(corpus.tokens("train"), SEQ)


@pytest.fixture(scope="module")
def registered(store, corpus) -> dict:
    return store.client().register_dataset("ds", corpus.path, "train", seq=SEQ)


@pytest.fixture(params=[True, False], ids=["shm", "net"])
def client(request, store, registered) -> StoreClient:
    c = store.client(local=request.param)
    assert c.is_local is request.param
    return c


def test_registration_info(store, registered, corpus, windows):
    assert registered["num_samples"] == len(windows)
    assert registered["tokens"] == len(corpus.tokens("train"))
    assert registered["dtype"] == "uint8" and registered["seq"] == SEQ
    assert os.path.samefile(registered["corpus"], corpus.path)
    c = store.client()
    assert [d["name"] for d in c.datasets()] == ["ds"]
    assert c.dataset_info("ds") == registered
    assert c.stats()["datasets"] == 1


def ref_rank_ids(state: dict, dp: int, rank: int, steps: int) -> list[np.ndarray]:
    s = ElasticSampler(state["num_samples"], state["global_batch"], state["seed"])
    s.load_state_dict(state)
    out = []
    for _ in range(steps):
        out.append(s.rank_ids(dp, rank).copy())
        s.advance()
    return out


@pytest.mark.parametrize("seed", [0, 7])
def test_ids_follow_the_sampler_through_dp_changes(store, registered, seed):
    """dp 1 -> 3 -> 2 mid-epoch and across an epoch boundary: the store's ids are the sampler's, and the ranks
    of every step together read exactly that step's global batch."""
    c = store.client()
    n = registered["num_samples"]
    sampler = ElasticSampler(n, GB, seed)
    bpe = sampler.batches_per_epoch
    # 1 -> 3 -> 2, the last stretch crossing into epoch 1; then a stretch starting mid-epoch 1
    plan = [(1, 2), (3, 3), (2, bpe - 5 + 2), (3, 4)]
    seen: dict[int, set[int]] = {}
    for dp, steps in plan:
        state = sampler.state_dict()
        per_rank = [c.dataset_ids("ds", state, dp, r, steps=steps) for r in range(dp)]
        for r in range(dp):
            assert len(per_rank[r]) == steps
            for got, want in zip(per_rank[r], ref_rank_ids(state, dp, r, steps), strict=True):
                assert got.dtype == np.int64
                np.testing.assert_array_equal(got, want)
        for k in range(steps):
            union = np.concatenate([per_rank[r][k] for r in range(dp)])
            np.testing.assert_array_equal(union, sampler.global_batch_ids())  # in order, each exactly once
            epoch = sampler.state.epoch
            assert not seen.setdefault(epoch, set()) & set(union.tolist())  # never twice in an epoch
            seen[epoch].update(union.tolist())
            sampler.advance()
    assert len(seen[0]) == bpe * GB  # the whole of epoch 0, then epoch 1 began
    assert sampler.state.epoch == 1 and sampler.state.consumed == 6 * GB


def test_read_matches_token_windows(client, store, windows):
    state = ElasticSampler(len(windows), GB, 3).state_dict()
    state.update(epoch=2, consumed=4 * GB)
    for rank in range(3):
        for ids in client.dataset_ids("ds", state, 3, rank, steps=3):
            out = np.empty((len(ids), SEQ + 1), dtype=np.uint8)
            client.read_samples("ds", ids, out)
            np.testing.assert_array_equal(out.astype(np.int64), windows.get(ids))
    # rank_samples: the same, listed and read in one call
    got = client.rank_samples("ds", state, 2, 1, steps=2)
    want = ref_rank_ids(state, 2, 1, 2)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(g.astype(np.int64), windows.get(w))
    # first and last samples, repeats, and an empty read
    ids = np.array([0, len(windows) - 1, 5, 5])
    out = np.empty((4, SEQ + 1), dtype=np.uint8)
    client.read_samples("ds", ids, out)
    np.testing.assert_array_equal(out.astype(np.int64), windows.get(ids))
    client.read_samples("ds", [], np.empty((0, SEQ + 1), np.uint8))


def test_network_read_larger_than_the_send_buffer(store, windows):
    """More bytes than the daemon's 8 MiB scratch buffer: sent in several gathered blocks."""
    c = store.client(local=False)
    ids = np.random.default_rng(1).integers(0, len(windows), size=600_000)
    out = np.empty((len(ids), SEQ + 1), dtype=np.uint8)
    c.read_samples("ds", ids, out)
    assert out.nbytes > 8 << 20
    np.testing.assert_array_equal(out.astype(np.int64), windows.get(ids))


def test_bad_inputs_are_clear_errors(store, registered, corpus, tmp_path):
    c = store.client()
    state = ElasticSampler(registered["num_samples"], GB, 0).state_dict()
    # unknown dataset, everywhere
    with pytest.raises(NotFoundError, match="unknown dataset"):
        c.dataset_ids("nope", state, 1, 0)
    with pytest.raises(NotFoundError):
        c.read_samples("nope", [0], np.empty((1, SEQ + 1), np.uint8))
    with pytest.raises(NotFoundError):
        c.drop_dataset("nope")
    with pytest.raises(BadRequestError, match="invalid job name"):
        c.register_dataset("a/b", corpus.path, seq=SEQ)
    # directories that are not corpora
    with pytest.raises(BadRequestError, match="not a directory"):
        c.register_dataset("x", tmp_path / "missing", seq=SEQ)
    (tmp_path / "empty").mkdir()
    with pytest.raises(BadRequestError, match="not a tenplex corpus"):
        c.register_dataset("x", tmp_path / "empty", seq=SEQ)
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "meta.json").write_text('{"hello": 1}')
    with pytest.raises(BadRequestError, match="not a tenplex corpus description"):
        c.register_dataset("x", fake, seq=SEQ)
    # a well-formed meta.json whose train.bin is a symlink to another file, or of the wrong size
    meta = json.loads((corpus.path / "meta.json").read_text())
    (fake / "meta.json").write_text(json.dumps(meta))
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * meta["splits"]["train"]["tokens"])
    (fake / "train.bin").symlink_to(secret)
    with pytest.raises(BadRequestError, match="symlinks are refused"):
        c.register_dataset("x", fake, seq=SEQ)
    (fake / "train.bin").unlink()
    (fake / "train.bin").write_bytes(b"s" * 100)
    with pytest.raises(BadRequestError, match=r"meta\.json says"):
        c.register_dataset("x", fake, seq=SEQ)
    with pytest.raises(BadRequestError, match="unknown split"):
        c.register_dataset("x", corpus.path, split="test", seq=SEQ)
    with pytest.raises(BadRequestError, match="fewer than one sample"):
        c.register_dataset("x", corpus.path, split="val", seq=SEQ)  # heldout=0: val is empty
    for seq in (0, -3, "16"):
        with pytest.raises(BadRequestError, match="seq must be"):
            c.register_dataset("x", corpus.path, seq=seq)  # type: ignore[arg-type]
    assert [d["name"] for d in c.datasets()] == ["ds"]  # nothing half-registered
    # impossible views
    with pytest.raises(BadRequestError, match="cannot be split over dp=13"):
        c.dataset_ids("ds", state, GB + 1, 0)
    with pytest.raises(BadRequestError, match="part 3 of 3"):
        c.dataset_ids("ds", state, 3, 3)
    for bad in ({"consumed": -GB}, {"epoch": -1}, {"consumed": 5}, {"num_samples": 10}, {"seed": -1}):
        with pytest.raises(BadRequestError):
            c.dataset_ids("ds", {**state, **bad}, 1, 0)
    with pytest.raises(BadRequestError, match="keys"):
        c.dataset_ids("ds", {"global_batch": GB}, 1, 0)
    with pytest.raises(BadRequestError, match="steps"):
        c.dataset_ids("ds", state, 1, 0, steps=0)
    # bad reads, on both paths
    for local in (True, False):
        cc = store.client(local=local)
        with pytest.raises(BadRequestError, match="out of range"):
            cc.read_samples("ds", [registered["num_samples"]], np.empty((1, SEQ + 1), np.uint8))
        with pytest.raises(BadRequestError, match="out of range"):
            cc.read_samples("ds", [-1], np.empty((1, SEQ + 1), np.uint8))
        with pytest.raises(BadRequestError):
            cc.read_samples("ds", [0], np.empty((1, SEQ + 1), np.float32))
        with pytest.raises(BadRequestError):
            cc.read_samples("ds", [0, 1], np.empty((1, SEQ + 1), np.uint8))
    # the daemon still answers, and the view still works
    assert c.health()["ok"]
    assert len(c.dataset_ids("ds", state, 2, 0)[0]) == GB // 2


def test_registration_maps_instead_of_copying(store, tmp_path):
    """Registering a 48 MiB corpus does not grow the daemon's RSS by anything like its size; a small read
    faults in only the pages it touches. Dropping and re-registering works."""
    write_texts(tmp_path / "big", [16 << 20] * 3, seed=5)
    big = build_corpus([tmp_path / "big"], root=tmp_path / "built", heldout=0.0)
    size = (big.path / "train.bin").stat().st_size
    assert size > 48 << 20
    c = store.client()
    before = c.stats()["rss"]
    info = c.register_dataset("big", big.path, seq=1024)
    after = c.stats()["rss"]
    assert after - before < 8 << 20, (before, after, size)
    out = np.empty((4, 1025), np.uint8)
    store.client(local=False).read_samples("big", [0, 10, 20, 30], out)
    assert c.stats()["rss"] - before < 8 << 20
    np.testing.assert_array_equal(
        out.astype(np.int64), TokenWindows(big.tokens("train"), 1024).get([0, 10, 20, 30])
    )
    assert info["num_samples"] == (size - 1) // 1024
    c.drop_dataset("big")
    assert [d["name"] for d in c.datasets()] == ["ds"]


def test_cli_lists_datasets(store, registered, capsys):
    assert cli_main(["store", "ls", "--store", store.url, "--datasets"]) == 0
    printed = capsys.readouterr().out
    assert "ds" in printed and str(registered["num_samples"]) in printed
