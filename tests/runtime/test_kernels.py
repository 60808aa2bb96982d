"""runtime.kernels: where and when numba compiles the kernels of formats.jit (background thread,
helper process, job mode once per node, ``dvidshards warm``), and what ``import dvidshards`` installs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numba
import numpy as np
import pytest

from dvidshards.formats import jit
from dvidshards.runtime import kernels as rk
from tests.support.exports import make_export

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def small_export(tmp_path_factory):
    return make_export(tmp_path_factory.mktemp("kernels") / "exp", shape=(130, 100, 70), scales=1)


# --- the Kernel object ---------------------------------------------------------------------------


@numba.njit(cache=False)
def _add(a, b):
    return a + b


def _kernel(fallback=lambda a, b: -(a + b)):
    # the fallback answers differently here only so that the tests can tell who answered
    return jit.Kernel(numba.njit(cache=False)(_add.py_func), [(numba.int64, numba.int64)], fallback,
                      exclusive=True)


def test_kernel_modes(monkeypatch):
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "fallback")
    k = _kernel()
    assert k(2, 3) == -5 and not k.ready
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "compiled")
    assert k(2, 3) == 5 and k.ready
    with jit.fallbacks():
        assert k(2, 3) == -5
    assert k(2, 3) == 5
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "background")
    k = _kernel()
    assert k(2, 3) == -5  # answered at once, compiled behind
    assert jit.wait(timeout=120)
    assert k.ready and k(2, 3) == 5
    with pytest.raises(TypeError):  # exclusive: no second signature is compiled in the caller's thread
        k(np.zeros(3), 3)
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "sometimes")
    with pytest.raises(ValueError, match="DVIDSHARDS_KERNELS"):
        _kernel()(1, 1)


def test_a_kernel_numba_cannot_compile_keeps_its_fallback(monkeypatch):
    @numba.njit(cache=False)
    def bad(a, b):
        return object()  # not supported in nopython mode

    k = jit.Kernel(bad, [(numba.int64, numba.int64)], lambda a, b: a * b)
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "compiled")
    with pytest.warns(RuntimeWarning, match="could not compile"):
        assert k(3, 4) == 12
    assert k.failed is not None and not k.ready
    assert k(3, 4) == 12  # no second attempt, no second warning
    assert "failed" in repr(k)




# --- a fresh process -------------------------------------------------------------------------------


def test_fresh_process_reads_before_numba_has_compiled(tmp_path, small_export):
    """With an empty numba cache the first chunks read at once, exactly; numba compiles behind."""
    want = small_export.expected(0)[64:128, 0:64, 0:64]
    np.save(tmp_path / "want.npy", want)
    script = textwrap.dedent(f"""
        import json, sys
        import numpy as np
        import dvidshards
        import dvidshards.runtime
        from dvidshards.formats import jit
        ds = dvidshards.Dataset({small_export.root!r})
        a = ds.open(0)[64:128, 0:64, 0:64].read(order="F").result()
        b = ds.read([[64, 0, 0], [128, 64, 64]], scale=0)
        want = np.load({str(tmp_path / "want.npy")!r})
        print(json.dumps({{"open": bool((a == want).all()), "read": bool((b == want).all()),
                          "status": jit.status()}}))
    """)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"), PYTHONPATH=str(ROOT))
    env.pop("DVIDSHARDS_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["open"] and out["read"]
    # the reads did not wait for numba: when they were done, some kernel was still compiling
    assert set(out["status"].values()) & {"queued", "compiling"}, out["status"]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_starts_its_own_compiler(monkeypatch):
    """A child forked while the parent compiles gets no compiler thread: it must start one."""
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "background")
    script = textwrap.dedent("""
        import os, sys, numba
        import dvidshards.runtime
        from dvidshards.formats import jit
        numba.njit(lambda a: a)(1)  # numba imports its typing modules on a first compile: not mid-fork
        for attempt in range(50):
            k = jit.kernel(numba.njit(cache=False)(lambda a, b: a + b), [(numba.int64, numba.int64)],
                           lambda a, b: -(a + b))
            assert k(1, 2) == -3  # queued in the parent, compiling now
            pid = os.fork()
            if pid == 0:
                if k.ready:  # the parent's compile ended before the fork: not the case under test
                    os._exit(2)
                # the first call may still find the parent's finished compile in numba (ready not yet
                # set at the fork); either way the child must end with the kernel compiled, not waiting
                # for a compiler thread it does not have
                ok = k(1, 2) in (-3, 3) and jit.wait(timeout=120) and k.ready and k(1, 2) == 3
                os._exit(0 if ok else 1)
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 2:
                sys.exit(os.waitstatus_to_exitcode(status))
        sys.exit("every compile ended before the fork")
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_waits_for_a_compile_inside_numba_so_the_child_can_compile():
    """A fork from a process where another thread is inside numba's compiler: the child can still
    compile (numba's lock is not left to a thread the child does not have, nor its call stack
    half-way), because the fork waits for that compile to end."""
    script = textwrap.dedent("""
        import os, sys, threading, numba
        import dvidshards.runtime
        numba.njit(lambda a: a)(1)  # numba's typing modules imported before any fork
        stop = threading.Event()
        def compile_forever():
            while not stop.is_set():
                numba.njit(cache=False)(lambda a, b: (a * b + a - b) // (b | 1))(3, 4)
        t = threading.Thread(target=compile_forever)
        t.start()
        bad = 0
        for i in range(10):
            pid = os.fork()
            if pid == 0:
                done = threading.Event()
                def child():
                    numba.njit(cache=False)(lambda a: a + 1)(1)
                    done.set()
                threading.Thread(target=child, daemon=True).start()
                os._exit(0 if done.wait(60) else 1)  # without the fix: waits forever or fails as re-entrant
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                bad += 1
                break
        stop.set()
        t.join()
        sys.exit(f"forked child {i + 1} could not compile" if bad else 0)
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_fork_that_could_not_wait_for_numba_leaves_a_child_that_says_so_and_never_hangs(monkeypatch):
    """When the compile in the parent outlasts the fork's wait, the child does not compile (it would
    wait forever for numba's lock): its kernels answer through the fallback, saying why once, and
    one without a fallback raises that reason."""
    monkeypatch.setenv("DVIDSHARDS_KERNELS", "background")
    script = textwrap.dedent("""
        import os, sys, threading, warnings, numba
        from numba.core.compiler_lock import global_compiler_lock
        from dvidshards.runtime import kernels
        from dvidshards.formats import jit
        numba.njit(lambda a: a)(1)
        held, release = threading.Event(), threading.Event()
        def hold():  # a compile that does not end while the fork waits
            with global_compiler_lock:
                held.set()
                release.wait()
        t = threading.Thread(target=hold, daemon=True)
        t.start()
        held.wait()
        kernels._FORK_WAIT = 0.2
        k = jit.kernel(numba.njit(cache=False)(lambda a, b: a + b), [(numba.int64, numba.int64)],
                       lambda a, b: -(a + b))
        bare = jit.kernel(numba.njit(cache=False)(lambda a: a * 2), [(numba.int64,)], None)
        pid = os.fork()
        if pid == 0:
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                answers = [k(1, 2)]
                jit.wait(timeout=60)
                answers.append(k(1, 2))
            said = [str(w.message) for w in seen if "forked while numba compiled" in str(w.message)]
            try:
                bare(1)
                raised = ""
            except RuntimeError as e:
                raised = str(e)
            ok = answers == [-3, -3] and not k.ready and len(said) == 1 and "spawn" in raised
            print(answers, said, raised, flush=True)
            os._exit(0 if ok else 1)
        _, status = os.waitpid(pid, 0)
        release.set()
        sys.exit(os.waitstatus_to_exitcode(status))
    """)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_a_kernel_without_fallback_compiles_at_first_call_in_every_mode(monkeypatch):
    """A kernel without a fallback compiles once at its first call and waits for it, in every mode."""
    for m in ("background", "fallback", "compiled"):
        monkeypatch.setenv("DVIDSHARDS_KERNELS", m)
        k = jit.Kernel(numba.njit(cache=False)(_add.py_func), [(numba.int64, numba.int64)], None, exclusive=True)
        assert k(2, 3) == 5 and k.ready
        with jit.fallbacks():
            assert k(2, 3) == 5  # nothing else can answer


# --- the helper process ----------------------------------------------------------------------------

_CALLER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)  # the fallback answers
    got = out.tolist()
    for _ in range(30000):  # (the 300 s hang guard) until the kernel is with the helper (it is blocked on the test's lock)
        if jit.status().get(mapping._apply_k.name) == "compiling" and rk._helper is not None:
            break
        time.sleep(0.01)
    print(json.dumps({"got": got, "status": jit.status(), "helper": rk._helper.pid}))
""")

_LOADER = textwrap.dedent("""
    import json
    import numpy as np
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    cached = rk.in_cache(mapping._apply_k)
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)
    jit.wait(timeout=300)
    d = mapping._apply_k.dispatcher
    got = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, got)
    print(json.dumps({"cached": cached, "ready": mapping._apply_k.ready, "helper": rk._helper is not None,
                      "hits": sum(d._cache_hits.values()), "misses": sum(d._cache_misses.values()),
                      "got": got.tolist() if (got == out).all() else None}))
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: flock")
@pytest.mark.slow  # child processes that compile
def test_exit_leaves_the_compile_to_the_helper_which_fills_the_cache(tmp_path, monkeypatch):
    """A process exits while its kernel is still being compiled: the helper process (blocked here
    on the cache lock the test holds) finishes it into numba's cache, where the next process
    loads it without compiling and without a helper."""
    import fcntl

    from dvidshards.formats import mapping

    cache = tmp_path / "numba"
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache), PYTHONPATH=str(ROOT))
    env.pop("DVIDSHARDS_KERNELS", None)
    monkeypatch.setenv("NUMBA_CACHE_DIR", str(cache))
    with open(rk._lock_path(mapping._apply_k), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            r = subprocess.run([sys.executable, "-c", _CALLER], capture_output=True, text=True, env=env,
                               timeout=300, cwd=str(tmp_path))  # a wait for the helper would never end
            assert r.returncode == 0, r.stderr
            out = json.loads(r.stdout.strip().splitlines()[-1])
            assert out["got"] == [5, 6, 3] and out["status"][mapping._apply_k.name] == "compiling", out
            os.kill(out["helper"], 0)  # still there, after its parent has gone
            assert not list(cache.rglob("mapping._apply-*.nbi"))
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    for _ in range(3000):  # the helper compiles now
        if list(cache.rglob("mapping._apply-*.nbi")):
            break
        time.sleep(0.1)
    r = subprocess.run([sys.executable, "-c", _LOADER], capture_output=True, text=True, env=env, timeout=300,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"cached": True, "ready": True, "helper": False, "hits": 1, "misses": 0, "got": [5, 6, 3]}, out


_TWO_KERNELS = textwrap.dedent("""
    import numba
    from dvidshards.formats import jit

    def _twice(a):
        return 2 * a

    def _thrice(a):
        return 3 * a

    twice = jit.kernel(numba.njit(cache=True)(_twice), [(numba.int64,)], lambda a: -2 * a)
    thrice = jit.kernel(numba.njit(cache=True)(_thrice), [(numba.int64,)], lambda a: -3 * a)
""")

_IDLE_CALLER = textwrap.dedent("""
    import json, time
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    rk._HELPER_IDLE = 0.5
    out = {"first": m.twice(4)}  # the fallback (negative) answers
    assert jit.wait(timeout=300)
    out["twice"] = m.twice(4)
    first = rk._helper
    for _ in range(30000):  # (the 300 s hang guard) the idle helper goes away, and is reaped
        if rk._helper is None and first.poll() is not None:
            break
        time.sleep(0.01)
    out["exited"] = first.returncode
    out["second"] = m.thrice(4)
    assert jit.wait(timeout=300)
    out["thrice"] = m.thrice(4)
    out["starts"] = rk._helper_starts
    out["broken"] = rk._helper_broken
    print(json.dumps(out))
""")


@pytest.mark.slow  # child processes that compile
def test_an_idle_helper_exits_and_a_new_one_starts_when_needed(tmp_path):
    (tmp_path / "mods").mkdir()
    (tmp_path / "mods" / "twokernels.py").write_text(_TWO_KERNELS)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), str(ROOT)]))
    env.pop("DVIDSHARDS_KERNELS", None)
    r = subprocess.run([sys.executable, "-c", _IDLE_CALLER], capture_output=True, text=True, env=env, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"first": -8, "twice": 8, "exited": 0, "second": -12, "thrice": 12, "starts": 2,
                   "broken": False}, out
    assert list((tmp_path / "numba").rglob("twokernels._thrice-*.nbi"))  # compiled by the second helper



# --- jobs: compiled at normal priority, once per node (runtime.kernels.prepare_for_job) ------------

_JOB = textwrap.dedent("""
    import json, os, sys, time
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    while not os.path.exists(sys.argv[1]):  # start with the other process
        time.sleep(0.002)
    rk.prepare_for_job()  # job mode only: each kernel is compiled at its first call
    first = {"twice": m.twice(4), "thrice": m.thrice(4)}
    assert jit.wait(timeout=300)
    out = {}
    for name, k in (("twice", m.twice), ("thrice", m.thrice)):
        d = k.dispatcher
        out[name] = {"first": first[name], "after": k(4), "misses": sum(d._cache_misses.values()),
                     "hits": sum(d._cache_hits.values())}
    out["helper"] = rk._helper_starts
    print(json.dumps(out))
""")


def _mods(tmp_path) -> dict:
    (tmp_path / "mods").mkdir(exist_ok=True)
    (tmp_path / "mods" / "twokernels.py").write_text(_TWO_KERNELS)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "numba"),
               PYTHONPATH=os.pathsep.join([str(tmp_path / "mods"), str(ROOT)]))
    env.pop("DVIDSHARDS_KERNELS", None)
    return env


def test_two_fresh_job_workers_compile_each_kernel_once_and_start_no_helper(tmp_path):
    """Two job processes starting together on an empty cache: every kernel is compiled once on
    the node (numba's cache misses over both processes), by whichever process called it first,
    whose call then ran the compiled code; the other loaded it from the cache. No helper process."""
    env = _mods(tmp_path)
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", _JOB, str(go)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path)) for _ in range(2)]
    go.write_text("")
    outs = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=600)
        assert p.returncode == 0, stderr
        outs.append(json.loads(stdout.strip().splitlines()[-1]))
    for name, want in (("twice", 8), ("thrice", 12)):
        assert sum(o[name]["misses"] for o in outs) == 1, outs  # compiled once on the node
        for o in outs:
            assert o[name]["after"] == want and o[name]["misses"] + o[name]["hits"] == 1, outs
            if o[name]["misses"]:  # the process that compiled it ran its first call compiled
                assert o[name]["first"] == want, outs
            else:
                assert o[name]["first"] in (want, -want), outs
    assert [o["helper"] for o in outs] == [0, 0]


_BLOCKED = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    rk.prepare_for_job(mapping._apply_k, wait=False)  # another process holds its lock: this one goes on
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)  # the fallback answers
    print(json.dumps({"got": out.tolist(), "ready": mapping._apply_k.ready,
                      "status": jit.status().get(mapping._apply_k.name)}), flush=True)
    sys.stdin.readline()  # the test lets go of the lock
    assert jit.wait(timeout=300)
    d = mapping._apply_k.dispatcher
    print(json.dumps({"ready": mapping._apply_k.ready, "misses": sum(d._cache_misses.values()),
                      "helper": rk._helper_starts}), flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: flock")
def test_a_job_answers_through_the_fallback_while_another_process_compiles(tmp_path, monkeypatch):
    """prepare_for_job(wait=False): a kernel another process compiles answers through its fallback,
    and is loaded (here: compiled, the other wrote nothing) once that process lets go."""
    import fcntl

    from dvidshards.formats import mapping

    env = _mods(tmp_path)
    monkeypatch.setenv("NUMBA_CACHE_DIR", env["NUMBA_CACHE_DIR"])  # the lock file is named after it
    with open(rk._kernel_lock_path(mapping._apply_k), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as a process compiling the kernel would
        p = subprocess.Popen([sys.executable, "-c", _BLOCKED], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, cwd=str(tmp_path))
        try:
            assert p.stdout is not None and p.stdin is not None
            first = json.loads(p.stdout.readline() or "null")
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    if first is None or first.pop("status") not in ("queued", "compiling"):  # in the job thread's hands
        p.kill()
        pytest.fail(f"{first}: {p.communicate()[1]}")
    assert first == {"got": [5, 6, 3], "ready": False}
    p.stdin.write("go\n")
    p.stdin.flush()
    stdout, stderr = p.communicate(timeout=600)
    assert p.returncode == 0, stderr
    # the lock's holder wrote nothing to the cache: this process compiled it itself, no helper
    assert json.loads(stdout.strip().splitlines()[-1]) == {"ready": True, "misses": 1, "helper": 0}


_PREPARE = textwrap.dedent("""
    import json, numba
    from dvidshards.errors import SpecError
    from dvidshards.formats import jit, mapping
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    out = {}
    rk.prepare_for_job("twokernels", "dvidshards.formats.mapping._apply")  # a module, a kernel's name
    out["ready"] = [m.twice.ready, m.thrice.ready, mapping._apply_k.ready]
    calls = []
    real = rk._resolve
    rk._resolve = lambda t: calls.append(t) or real(t)
    rk.prepare_for_job("twokernels", "dvidshards.formats.mapping._apply")
    out["again"] = len(calls)  # done: nothing resolved again
    for bad in ("dvidshards.formats.nosuchthing", "dvidshards.errors"):
        try:
            rk.prepare_for_job(bad)
        except SpecError as e:
            out.setdefault("errors", []).append(str(e))
    k = jit.Kernel(numba.njit(cache=False)(lambda a: a + 1), [(numba.int64,)], lambda a: -a)
    out["uncached"] = k(1)  # not cacheable (not registered): compiled here at its first call
    print(json.dumps(out))
""")


def test_prepare_for_job_names_kernels_and_modules_and_is_cheap_once_done(tmp_path):
    env = _mods(tmp_path)
    r = subprocess.run([sys.executable, "-c", _PREPARE], capture_output=True, text=True, env=env, timeout=600,
                       cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["ready"] == [True, True, True] and out["again"] == 0 and out["uncached"] == 2, out
    assert len(out["errors"]) == 2 and all("neither a kernel of dvidshards nor a module" in e for e in out["errors"])



_WARM = textwrap.dedent("""
    import argparse, sys
    from dvidshards.runtime import kernels
    p = argparse.ArgumentParser()
    kernels.add_arguments(p)
    sys.exit(kernels.main(p.parse_args(sys.argv[1:])))
""")

_LOAD_TWO = textwrap.dedent("""
    import json
    from dvidshards.formats import jit
    from dvidshards.runtime import kernels as rk
    import twokernels as m
    out = {"cached": [rk.in_cache(m.twice), rk.in_cache(m.thrice)]}
    rk.prepare_for_job("twokernels")
    d = [m.twice.dispatcher, m.thrice.dispatcher]
    out["misses"] = sum(sum(x._cache_misses.values()) for x in d)
    out["hits"] = sum(sum(x._cache_hits.values()) for x in d)
    print(json.dumps(out))
""")


@pytest.mark.slow  # child processes that compile
def test_warm_fills_the_cache_in_two_processes_and_check_says_so(tmp_path):
    env = _mods(tmp_path)

    def warm(*args):
        return subprocess.run([sys.executable, "-c", _WARM, *args], capture_output=True, text=True, env=env,
                              timeout=600, cwd=str(tmp_path))

    r = warm("--check", "twokernels")
    assert r.returncode == 1 and "not in the cache: twokernels._twice" in r.stdout, r.stdout + r.stderr
    r = warm("-j", "2", "twokernels")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "2 kernels ready in numba's cache" in r.stdout and str(tmp_path / "numba") in r.stdout, r.stdout
    assert warm("--check", "twokernels").returncode == 0
    r = subprocess.run([sys.executable, "-c", _LOAD_TWO], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"cached": [True, True], "misses": 0, "hits": 2}
    r = warm("no.such.module")
    assert r.returncode != 0 and "neither a kernel of dvidshards nor a module" in r.stderr


def test_import_dvidshards_installs_the_runtime():
    """``import dvidshards`` alone installs the kernel compiler, the mapping file cache and the
    fork guard of ``dvidshards.runtime`` (formats imports nothing above it)."""
    code = textwrap.dedent("""
        import json, sys
        import dvidshards
        from dvidshards.formats import jit, mapping
        print(json.dumps([type(jit.installed_compiler()).__module__, type(mapping.installed_files()).__module__,
                          "dvidshards.runtime.forks" in sys.modules]))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == ["dvidshards.runtime.kernels", "dvidshards.runtime.mappings", True]


_WAITING = textwrap.dedent("""
    import json, sys
    import numpy as np
    from dvidshards.formats import mapping
    from dvidshards.runtime import kernels as rk
    rk.prepare_for_job()  # job mode; a kernel another process compiles is waited for
    keys, values = np.array([1, 2], np.uint64), np.array([5, 6], np.uint64)
    out = np.zeros(3, np.uint64)
    print("calling", flush=True)
    mapping._apply_k(np.array([1, 2, 3], np.uint64), keys, values, out)
    d = mapping._apply_k.dispatcher
    print(json.dumps({"got": out.tolist(), "ready": mapping._apply_k.ready, "misses": sum(d._cache_misses.values()),
                      "threads": [t.name for t in __import__("threading").enumerate()]}), flush=True)
""")


@pytest.mark.skipif(not hasattr(os, "fork"), reason="POSIX: flock")
def test_a_job_waits_for_the_process_compiling_a_kernel_then_runs_it_compiled(tmp_path, monkeypatch):
    """The default (prepare_for_job(wait=True)): the first call of a kernel another process holds
    waits for that process (no fallback work beside its compile), then runs the compiled code."""
    import fcntl
    import select

    from dvidshards.formats import mapping

    env = _mods(tmp_path)
    monkeypatch.setenv("NUMBA_CACHE_DIR", env["NUMBA_CACHE_DIR"])
    with open(rk._kernel_lock_path(mapping._apply_k), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        p = subprocess.Popen([sys.executable, "-c", _WAITING], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env, cwd=str(tmp_path))
        try:
            assert p.stdout is not None
            assert p.stdout.readline().strip() == "calling"
            answered = select.select([p.stdout], [], [], 2.0)[0]  # nothing while the lock is held
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    stdout, stderr = p.communicate(timeout=600)
    assert not answered and p.returncode == 0, stderr
    out = json.loads(stdout.strip().splitlines()[-1])
    assert out["got"] == [5, 6, 3] and out["ready"] and out["misses"] == 1, out
    assert not any(t.startswith("dvidshards-kernels") for t in out["threads"]), out  # no thread, no helper
