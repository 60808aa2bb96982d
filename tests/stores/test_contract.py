"""The store contract: what every store does, checked the same way against each of them.

``ReadContract`` holds what every store answers (read, ranges, get, size, open, list); a subclass
gives a way to put files there (``seed``). ``WriteContract`` adds what a writable store does
(atomic put, streamed writes, create-if-absent, replace-if-equal, delete, delete of a folder, a
read-only view, sub-stores), against local folders, memory, S3 (moto), GCS (the emulator) and,
read-only, http(s) (a loopback HTTP server); all in the default tier (the remote ones take ~5 s).
"""

from __future__ import annotations

import io
import os
import pickle
import threading
import uuid

import pytest

from dvidshards.errors import MissingShardError, OutputError
from dvidshards.stores import (
    ByteStore,
    LocalStore,
    MemoryStore,
    PastEndError,
    ReadOnlyError,
    as_store,
)
from tests.support.servers import FakeGCS, MotoS3, RangeServer

BLOB = bytes(range(256)) * 40  # 10,240 bytes, every value in it


class ReadContract:
    """What every store answers; ``store`` and ``seed(key, data)`` come from the subclass."""

    can_list = True

    @pytest.fixture
    def store(self) -> ByteStore:
        raise NotImplementedError

    def seed(self, store: ByteStore, key: str, data: bytes) -> None:
        raise NotImplementedError

    def test_a_file_reads_back_whole_and_by_range(self, store):
        self.seed(store, "s0/a.arrow", BLOB)
        assert bytes(store.read_sync("s0/a.arrow")) == BLOB
        assert store.get_sync("s0/a.arrow") == BLOB
        assert bytes(store.read_sync("s0/a.arrow", 100, 1100)) == BLOB[100:1100]
        assert bytes(store.read_sync("s0/a.arrow", -16)) == BLOB[-16:]  # the last 16 bytes
        got = store._sync(store.read_ranges("s0/a.arrow", [(0, 10), (5000, 5100), (10230, 10240)]))
        assert [bytes(g) for g in got] == [BLOB[:10], BLOB[5000:5100], BLOB[10230:]]

    def test_a_missing_file_is_missing_and_get_gives_none(self, store):
        with pytest.raises(MissingShardError, match="nope"):
            store.read_sync("s0/nope.arrow")
        assert store.get_sync("s0/nope.arrow") is None
        assert not store.exists_sync("s0/nope.arrow")

    def test_a_range_past_the_end_is_refused(self, store):
        self.seed(store, "f", BLOB)
        with pytest.raises(PastEndError):
            store.read_sync("f", 10_000, 10_300)

    def test_size_and_a_seekable_file_view(self, store):
        self.seed(store, "t/big.parquet", BLOB)
        assert store.size_sync("t/big.parquet") == len(BLOB)
        assert store.exists_sync("t/big.parquet")
        with store.open("t/big.parquet") as f:
            assert f.seekable() and f.read(4) == BLOB[:4]
            f.seek(-10, io.SEEK_END)
            assert f.read() == BLOB[-10:]
            f.seek(3000)
            assert f.read(7) == BLOB[3000:3007] and f.tell() == 3007
        with pytest.raises(MissingShardError):
            store.open("t/none.parquet")

    def test_list_gives_the_names_directly_below_a_folder(self, store):
        if not self.can_list:
            pytest.skip("this store cannot list")
        for key in ("a/x", "a/y/z", "a/y/w", "ab", "b/c"):
            self.seed(store, key, b"1")
        assert store.list_sync() == ["a", "ab", "b"]
        assert store.list_sync("a") == ["x", "y"] == store.list_sync("a/")
        assert store.list_sync("a/y") == ["w", "z"]
        assert store.list_sync("nothing") == []
        assert store.list_prefix_sync("a") == ["a/x", "a/y/w", "a/y/z"]
        assert store.list_prefix_sync() == ["a/x", "a/y/w", "a/y/z", "ab", "b/c"]
        assert store.is_folder_sync("a/y") and not store.is_folder_sync("q")


class WriteContract(ReadContract):
    """What a writable store does; ``store`` is empty and writable."""

    def seed(self, store, key, data):
        store.put_sync(key, data)

    def test_put_replaces_a_file_whole(self, store):
        store.put_sync("m.json", b"first version, longer")
        store.put_sync("m.json", b"second")
        assert store.get_sync("m.json") == b"second"

    def test_a_streamed_write_appears_only_when_complete(self, store):
        with store.writer("s1/part.parquet") as f:
            for k in range(10):
                f.write(BLOB[k * 1024:(k + 1) * 1024])
                assert store.get_sync("s1/part.parquet") is None  # nothing under the name yet
            if self.can_list:
                assert store.list_sync("s1") == []  # its temporary name is hidden
        assert store.get_sync("s1/part.parquet") == BLOB
        if self.can_list:
            assert store.list_sync("s1") == ["part.parquet"]

    def test_a_write_that_fails_publishes_nothing_and_leaves_nothing(self, store):
        store.put_sync("keep", b"old")
        with pytest.raises(RuntimeError, match="boom"), store.writer("keep") as f:
            f.write(b"half")
            raise RuntimeError("boom")
        assert store.get_sync("keep") == b"old"
        if self.can_list:
            assert store.list_prefix_sync() == ["keep"]

    def test_create_writes_only_where_nothing_is(self, store):
        assert store.create_sync("_dvidshards.lock", b"mine")
        assert not store.create_sync("_dvidshards.lock", b"theirs")
        assert store.get_sync("_dvidshards.lock") == b"mine"

    def test_create_from_many_threads_lets_exactly_one_win(self, store):
        wins, errors = [], []

        def take(k: int) -> None:
            try:
                if store.create_sync("lock", f"owner {k}".encode()):
                    wins.append(k)
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                errors.append(e)

        threads = [threading.Thread(target=take, args=(k,)) for k in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and len(wins) == 1
        assert store.get_sync("lock") == f"owner {wins[0]}".encode()

    def test_replace_writes_only_over_what_was_expected(self, store):
        assert not store.replace_sync("lock", b"b", expected=b"a")  # absent
        store.put_sync("lock", b"a")
        assert not store.replace_sync("lock", b"c", expected=b"x")
        assert store.get_sync("lock") == b"a"
        assert store.replace_sync("lock", b"b", expected=b"a")
        assert store.get_sync("lock") == b"b"

    def test_delete_and_delete_a_folder(self, store):
        for key in ("w/a", "w/sub/b", "w/sub/c/d", "wx", "other/e"):
            store.put_sync(key, b"1")
        store.delete_sync("w/a")
        store.delete_sync("w/a")  # absent: nothing to do
        assert store.get_sync("w/a") is None
        store.delete_prefix_sync("w/sub")
        assert store.get_sync("w/sub/b") is None and store.get_sync("w/sub/c/d") is None
        assert store.get_sync("wx") == b"1" and store.get_sync("other/e") == b"1"  # a name that only starts alike
        store.delete_prefix_sync("nothing/here")
        store.delete_prefix_sync()
        assert store.get_sync("wx") is None and store.get_sync("other/e") is None
        if self.can_list:
            assert store.list_sync() == []

    def test_a_read_only_view_refuses_every_write_naming_the_location(self, store):
        store.put_sync("x", b"1")
        ro = store.as_read_only()
        assert ro.read_only and not store.read_only
        assert ro.get_sync("x") == b"1"
        writes = [lambda: ro.put_sync("y", b"2"), lambda: ro.create_sync("y", b"2"),
                  lambda: ro.replace_sync("x", b"2", expected=b"1"), lambda: ro.delete_sync("x"),
                  lambda: ro.delete_prefix_sync(""), lambda: ro.writer("y").__enter__(),
                  lambda: ro.check_writable()]
        for write in writes:
            with pytest.raises(ReadOnlyError, match="read-only") as e:
                write()
            assert isinstance(e.value, OutputError) and ro.describe("").rstrip("/") in str(e.value)
        assert store.get_sync("x") == b"1" and store.get_sync("y") is None
        store.check_writable()

    def test_a_child_store_is_the_folder_below(self, store):
        sub = store.child("job/shards")
        sub.put_sync("a.arrow", b"A")
        assert store.get_sync("job/shards/a.arrow") == b"A"
        assert sub.describe("a.arrow") == store.describe("job/shards/a.arrow")
        assert type(sub) is type(store) and sub.read_only == store.read_only
        if self.can_list:
            assert sub.list_sync() == ["a.arrow"]
        sub.delete_prefix_sync()
        assert store.get_sync("job/shards/a.arrow") is None

    def test_a_store_pickles_as_its_location(self, store):
        store.put_sync("p/q", b"data")
        again = pickle.loads(pickle.dumps(store))
        assert again.get_sync("p/q") == b"data" and again.read_only == store.read_only
        assert pickle.loads(pickle.dumps(store.as_read_only())).read_only


# --------------------------------------------------------------------------- the stores


class TestLocalStore(WriteContract):
    @pytest.fixture
    def store(self, tmp_path):
        return as_store(tmp_path / "out", writable=True)

    def test_is_a_local_store_writing_through_hidden_temporaries(self, store, tmp_path):
        assert isinstance(store, LocalStore) and store.local_path("a") == str(tmp_path / "out" / "a")
        (tmp_path / "out").mkdir()
        (tmp_path / "out" / ".part.tmp-0123abcd").write_bytes(b"left by a killed writer")
        assert store.list_sync() == [] and store.list_prefix_sync() == []

    def test_a_folder_is_read_only_when_opened_for_reading(self, tmp_path):
        (tmp_path / "exp").mkdir()
        ro = as_store(tmp_path / "exp")
        assert ro.read_only
        with pytest.raises(ReadOnlyError, match=str(tmp_path / "exp" / "info")):
            ro.put_sync("info", b"{}")
        assert not (tmp_path / "exp" / "info").exists()


class TestMemoryStore(WriteContract):
    @pytest.fixture
    def store(self):
        return as_store(f"memory://contract-{uuid.uuid4().hex[:8]}/root", writable=True)

    def test_memory_urls_name_one_store_per_process(self, store):
        store.put_sync("k", b"v")
        name = store.describe("").removeprefix("memory://").split("/", 1)[0]
        assert as_store(f"memory://{name}/root").get_sync("k") == b"v"
        assert isinstance(store, MemoryStore)


# the remote stores: one server per module, a fresh prefix per test (moto keeps one backend per process)


@pytest.fixture(scope="module")
def s3():
    pytest.importorskip("moto.server")
    with MotoS3() as server:
        server.bucket("contract")
        yield server


def _honour_generation_match() -> None:
    """Teach the GCS emulator ``ifGenerationMatch`` on uploads, as GCS does (0: only if absent),
    one upload at a time: what TensorStore's conditional writes (create, replace) rely on."""
    from http import HTTPStatus

    from gcp_storage_emulator import server
    from gcp_storage_emulator.handlers import objects

    if getattr(objects, "_generation_match", False):
        return
    real, lock = objects.insert, threading.Lock()

    def insert(request, response, storage, *args, **kwargs):
        want, name = (request.query.get(k, [None])[0] for k in ("ifGenerationMatch", "name"))
        with lock:
            if want is not None and name is not None:
                try:
                    held = str(storage.get_file_obj(request.params["bucket_name"], name)["generation"])
                except Exception:  # noqa: BLE001 - no such object
                    held = "0"
                if held != want:
                    response.status = HTTPStatus.PRECONDITION_FAILED
                    response.json({"error": {"code": 412, "message": "conditionNotMet"}})
                    return None
            return real(request, response, storage, *args, **kwargs)

    for _, handlers in server.HANDLERS:
        if handlers.get(server.POST) is real:
            handlers[server.POST] = insert
    objects._generation_match = True


@pytest.fixture(scope="module")
def gcs():
    pytest.importorskip("gcp_storage_emulator")
    _honour_generation_match()
    with FakeGCS() as server:
        server.bucket("contract")
        yield server


class TestS3Store(WriteContract):
    @pytest.fixture
    def store(self, s3):
        host = s3.endpoint.removeprefix("http://")
        return as_store(f"s3://contract/{uuid.uuid4().hex[:8]}/?endpoint_override={host}&scheme=http",
                        writable=True)


class TestGcsStore(WriteContract):
    @pytest.fixture
    def store(self, gcs):
        return as_store(f"gs://contract/{uuid.uuid4().hex[:8]}/", writable=True)


class TestHttpStore(ReadContract):
    """http(s) is read-only: it reads like any store and refuses every write."""

    can_list = False  # an http server gives no listing

    @pytest.fixture(scope="class")
    @classmethod
    def served(cls, tmp_path_factory):
        root = tmp_path_factory.mktemp("served")
        with RangeServer(root) as server:
            yield root, server

    @pytest.fixture
    def store(self, served):
        root, server = served
        sub = uuid.uuid4().hex[:8]
        os.makedirs(root / sub)
        self.root = root / sub
        return as_store(server.url + sub + "/")

    def seed(self, store, key, data):
        path = self.root / key
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)

    def test_every_write_is_refused_naming_the_url(self, store, served):
        self.seed(store, "info", b"{}")
        assert store.read_only
        for write in (lambda: store.put_sync("info", b"x"), lambda: store.create_sync("new", b"x"),
                      lambda: store.delete_sync("info"), lambda: store.check_writable()):
            with pytest.raises(ReadOnlyError, match=store.describe("").rstrip("/")):
                write()
        assert (self.root / "info").read_bytes() == b"{}"
        with pytest.raises(OutputError, match="not http://"):
            as_store(served[1].url + "x/", writable=True)
