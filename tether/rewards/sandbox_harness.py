"""The two programs that run *inside* the sandbox.

Run as ``python -I -S -c <sandbox_codec's source + this file's> runner|grader``: stdlib only, no
tether import (the sandbox's root holds the system's /usr, not our venv).

Why two processes. Whatever runs in the same interpreter as the candidate's code is the
candidate's: it can patch builtins, install a tracer that skips asserts, exit 0 early, register
an atexit hook, or re-exec itself with -O. So nothing that decides the verdict runs there:

  * runner (untrusted, uid U1): executes the candidate's code, then answers requests ("call
    `add` with (1, 2)") with plain-data values. It never sees a test, an expected value or the
    nonce; it can lie, but it can only lie about values, and it does not know the right ones.
  * grader (uid U2, no candidate code ever loaded): executes the row's tests, statement by
    statement; every name the tests use that the candidate defined is a `Remote` proxy that
    asks the runner. Values come back as builtin types decoded from JSON (never the candidate's
    objects), so an `__eq__` that always says yes never takes part in a comparison. Only when
    every statement has returned does it write the per-run nonce to fd 5, a pipe to the trainer
    that no other process holds.

I/O-style tests (stdin -> stdout, function call -> result) need no grader: the runner sends the
outputs to the trainer, which compares them (tether.rewards.sandbox_host).
"""

import json
import os
import sys

try:                                # in the sandbox, sandbox_codec's source is prepended instead
    from tether.rewards.sandbox_codec import (RunnerRef, decode, describe_error, describe_text, encode,
                                              read_exact, recv, send)
except ImportError:
    pass


# --- runner: the candidate's process ---------------------------------------------------------

def _print_exc(e):
    import traceback
    tb = e.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename == "<string>":
        tb = tb.tb_next                       # our frames: only the program's are of interest
    traceback.print_exception(type(e), e, tb)


def _stdio_cases(job, out_fd):
    """Each stdin -> stdout case in a fresh fork of this process (cheaper than a new interpreter;
    the candidate's code has not run yet when we fork)."""
    try:
        code = compile(job["code"], "main.py", "exec")
    except SyntaxError as e:
        _print_exc(e)
        send(out_fd, {"load_error": "SyntaxError: %s" % (e.msg,)})
        return
    for i, (text, cap) in enumerate(zip(job["inputs"], job["caps"])):
        inp = os.memfd_create("stdin")
        os.write(inp, text.encode())
        os.lseek(inp, 0, 0)
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.dup2(inp, 0)
            os.dup2(w, 1)
            for fd in (inp, r, w, out_fd):
                os.close(fd)
            sys.stdin = open(0, "r", closefd=False)
            sys.stdout = open(1, "w", closefd=False)
            status = 0
            try:
                _load_code(code)
            except BaseException as e:
                _print_exc(e)
                status = 1
            try:
                sys.stdout.flush()
            except BaseException:
                status = 1
            os._exit(status)
        os.close(w)
        os.close(inp)
        out, over = bytearray(), False
        while True:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > cap:
                over = True
                os.kill(pid, 9)
                break
        os.close(r)
        _, st = os.waitpid(pid, 0)
        send(out_fd, {"case": i, "out": out[:cap].decode("utf-8", "replace"),
                      "status": st, "over": over})


def _load_code(code):
    """Execute the candidate's code as `__main__`. SystemExit(0) ends the load, not the run:
    the verdict comes from the tests or the outputs, so exiting early gains nothing."""
    import types
    mod = types.ModuleType("__main__")
    mod.__file__ = "main.py"
    sys.modules["__main__"] = mod
    sys.argv = ["main.py"]
    try:
        exec(code, mod.__dict__)
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    return mod


def _flush():
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except BaseException:
            pass


def _deref(refs):
    def get(i, _type=None):
        if type(i) is not int or not 0 <= i < len(refs):
            raise ValueError("bad object reference")
        return refs[i]
    return get


def _call(refs, req):
    fn = _deref(refs)(req["ref"])
    args = [decode(a, _deref(refs)) for a in req["args"]]
    kw = {k: decode(v, _deref(refs)) for k, v in req["kw"].items()}
    result = fn(*args, **kw)
    mut = {str(i): encode(a, refs) for i, a in enumerate(args)
           if type(a) in (list, dict, set, bytearray)}        # in-place changes go back too
    return {"v": encode(result, refs), "mut": mut}


def _serve(mod, rfd, wfd):
    """Answer the grader until it hangs up. Each request is independent; failures are values."""
    import itertools
    refs = []
    get = _deref(refs)
    ops = {
        "get": lambda q: {"v": encode(mod.__dict__[q["name"]], refs)},
        "call": lambda q: _call(refs, q),
        "attr": lambda q: {"v": encode(getattr(get(q["ref"]), q["name"]), refs)},
        "iter": lambda q: {"v": encode(list(itertools.islice(get(q["ref"]), 1_000_000)), refs)},
        "len": lambda q: {"v": encode(len(get(q["ref"])), refs)},
        "item": lambda q: {"v": encode(get(q["ref"])[decode(q["key"], get)], refs)},
        "eq": lambda q: {"v": bool(get(q["ref"]) == get(q["other"]))},
    }
    while True:
        try:
            req = recv(rfd)
        except EOFError:
            return
        try:
            reply = ops[req["op"]](req)
        except BaseException as e:
            reply = describe_error(e)
        reply["seq"] = req["seq"]
        _flush()
        send(wfd, reply)


def runner():
    job = json.loads(read_exact(0, os.fstat(0).st_size))
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)          # fd 0 again: input() sees EOF, not the job
    sys.stdin = open(0, "r", closefd=False)
    mode = job["mode"]
    if mode == "stdio":
        return _stdio_cases(job, 3)
    if mode == "plain":                         # no tests: the exit status is all there is
        try:
            _load_code(compile(job["code"], "main.py", "exec"))
        except SystemExit as e:
            sys.stdout.flush()
            if not isinstance(e.code, int):
                print(e.code, file=sys.stderr)
            os._exit(e.code if isinstance(e.code, int) else 1)
        except BaseException as e:
            _print_exc(e)
            sys.stdout.flush()
            os._exit(1)
        return
    out_fd = 3
    try:
        mod = _load_code(compile(job["code"], "main.py", "exec"))
    except BaseException as e:
        _print_exc(e)
        send(out_fd, {"load_error": describe_text(e)})
        return
    _flush()                                    # init kills us once the verdict is in
    import types
    names = {k: [type(v).__name__[:80], v.__name__ if isinstance(v, types.ModuleType) else None]
             for k, v in list(mod.__dict__.items()) if not k.startswith("__")}
    send(out_fd, {"ready": names})
    if mode == "serve":
        return _serve(mod, 4, out_fd)
    refs = []                                   # mode "calls": function call -> value pairs
    for i, c in enumerate(job["calls"]):
        try:
            refs[:] = [mod.__dict__[c["fn"]]]
            reply = _call(refs, {"ref": 0, "args": c["args"], "kw": c.get("kw", {})})
        except BaseException as e:
            reply = describe_error(e)
        reply["case"] = i
        _flush()
        send(out_fd, reply)


# --- grader: the tests' process; no candidate code is ever loaded here ------------------------

class RemoteGone(Exception):
    """The runner died or broke the protocol mid-test (its exit status says why)."""


class RemoteError(Exception):
    """The candidate raised an exception that is not a builtin one."""


def _stdlib(name):
    return name.partition(".")[0] in getattr(sys, "stdlib_module_names", ())


def grader():
    import ast
    import builtins
    import importlib
    try:   # same-uid setups: keep /proc/<pid>/{mem,fd} of this process away from the candidate
        import ctypes
        ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)          # PR_SET_DUMPABLE 0
    except Exception:
        pass
    job = json.loads(read_exact(0, os.fstat(0).st_size))
    os.close(0)
    os.open(os.devnull, os.O_RDONLY)
    to_runner, from_runner, verdict = 3, 4, 5
    seq = [0]

    def rpc(**req):
        seq[0] += 1
        req["seq"] = seq[0]
        try:
            send(to_runner, req)
            reply = recv(from_runner)
        except (OSError, EOFError, ValueError, RecursionError) as e:
            raise RemoteGone("the program stopped answering (%s)" % (type(e).__name__,))
        if not isinstance(reply, dict) or reply.get("seq") != seq[0]:
            raise RemoteGone("the program broke the test protocol")
        if "raise" in reply:
            exc = getattr(builtins, str(reply["raise"]), None)
            if not (isinstance(exc, type) and issubclass(exc, Exception)):
                exc = RemoteError
            raise exc("%s (raised in the program)" % (reply.get("msg", ""),))
        return reply

    class Remote:
        """Stands for an object that lives in the runner. It compares equal only to the same
        object (an eq request when both sides are remote), so candidate __eq__ code never
        decides a comparison with a test's literal."""
        __slots__ = ("ref", "type")

        def __init__(self, ref, type_name):
            self.ref, self.type = ref, type_name

        def __call__(self, *args, **kw):
            enc_args = [encode(_local(a)) for a in args]
            reply = rpc(op="call", ref=self.ref, args=enc_args,
                        kw={k: encode(_local(v)) for k, v in kw.items()})
            for i, new in reply.get("mut", {}).items():
                _apply_mutation(args[int(i)], val(new))
            return val(reply["v"])

        def __getattr__(self, name):
            if name.startswith("__"):
                raise AttributeError(name)
            return val(rpc(op="attr", ref=self.ref, name=name)["v"])

        def __iter__(self):
            return iter(val(rpc(op="iter", ref=self.ref)["v"]))

        def __len__(self):
            return val(rpc(op="len", ref=self.ref)["v"])

        def __getitem__(self, key):
            return val(rpc(op="item", ref=self.ref, key=encode(_local(key)))["v"])

        def __eq__(self, other):
            if isinstance(other, Remote):
                return other.ref == self.ref or rpc(op="eq", ref=self.ref, other=other.ref)["v"] is True
            return False

        def __ne__(self, other):
            return not self.__eq__(other)

        __hash__ = object.__hash__

        def __repr__(self):
            return "<%s object in the sandbox>" % (self.type,)

    def _local(x):
        # A Remote is passed back as its reference; encode() sees a marker dict, not the object.
        return RunnerRef(x.ref) if isinstance(x, Remote) else x

    def val(o):
        return decode(o, Remote)

    try:
        ready = recv(from_runner)
    except (OSError, EOFError, ValueError, RecursionError) as e:
        ready = {"load_error": "it ended before its functions could be tested (%s)" % (
            type(e).__name__,)}
    if not isinstance(ready, dict) or not (isinstance(ready.get("ready"), dict)
                                           or "load_error" in ready):
        ready = {"load_error": "it broke the test protocol"}
    if "load_error" in ready:
        send(verdict, {"pass": False, "error": "the program failed to load: %s" % (
            ready["load_error"],)})
        return
    try:
        tree = ast.parse(job["tests"], "<tests>")
    except SyntaxError as e:
        send(verdict, {"pass": False, "bad_tests": True, "error": "tests do not compile: %s" % e})
        return
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    called = {n.func.id for n in ast.walk(tree)
              if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
    ns = {"__name__": "__tests__", "__builtins__": builtins}
    shadowed = sorted(n for n in ready["ready"] if isinstance(n, str) and n in used
                      and hasattr(builtins, n))
    if shadowed:    # abs, len, AssertionError, ...: whose is it? Ambiguous, so fail closed.
        send(verdict, {"pass": False, "error": "the program redefines %s, which the tests use"
                       % ", ".join(shadowed[:5])})
        return
    for name, info in ready["ready"].items():
        if not isinstance(name, str) or name not in used:
            continue
        kind, module = info if isinstance(info, list) and len(info) == 2 else (None, None)
        try:
            # A module the tests use (math.isclose) is the real one, imported here, never the
            # program's object of that name (a fake whose isclose always says yes).
            if kind == "module" and isinstance(module, str) and _stdlib(module):
                ns[name] = importlib.import_module(module)
            elif _stdlib(name) and name not in called:
                ns[name] = importlib.import_module(name)
            else:
                ns[name] = val(rpc(op="get", name=name)["v"])
        except Exception:
            pass                          # a NameError in the test that uses it says enough
    for i, stmt in enumerate(tree.body):
        try:
            exec(compile(ast.Module([stmt], []), "<tests>", "exec"), ns)
        except BaseException as e:
            send(verdict, {"pass": False, "test": i, "line": stmt.lineno,
                           "error": describe_text(e),
                           "gone": isinstance(e, RemoteGone)})
            return
    send(verdict, {"pass": True, "nonce": job["nonce"], "tests": len(tree.body)})


def _apply_mutation(local, new):
    """Copy an in-place change the candidate made to an argument back onto the test's object."""
    try:
        if type(local) in (list, bytearray) and type(new) is type(local):
            local[:] = new
        elif type(local) in (dict, set) and type(new) is type(local):
            local.clear()
            local.update(new)
    except Exception:
        pass


def grade():
    """The grader, failing closed: any error of its own is a failed verdict, never a crash."""
    try:
        grader()
    except BaseException as e:
        try:
            send(5, {"pass": False, "error": "grader error: " + describe_text(e)})
        except OSError:
            pass


if __name__ == "__main__" and len(sys.argv) > 1:
    {"runner": runner, "grader": grade}[sys.argv[1]]()
    _flush()
