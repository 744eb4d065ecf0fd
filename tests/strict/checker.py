"""strict-gpu: find the races Triton's interpreter hides, by hooking the interpreter.

Triton's interpreter (``TRITON_INTERPRET=1``, triton 3.9) runs a launch's programs one after another,
a tensor op's lanes all at once, a duplicate-address store as "last lane wins" and
``tl.debug_barrier`` as a no-op. A GPU runs the programs (CTAs) concurrently, spreads one program's
lanes over its warps, and makes a global store by one thread visible to another thread of the CTA
only after a barrier (Triton adds barriers for its own shared memory only). A :class:`Checker`
active around interpreted launches records every global memory access and reports what would be
unordered on a GPU.

Thread model (a model of Triton's lowering, not its exact layout)
-----------------------------------------------------------------
* Element ``k`` of a tensor op whose pointer has shape ``S`` (more than one element) is done by
  thread ``(S, k)``: the same thread for the same shape and index in every op of the program, a
  different thread for another index or another shape.
* An op with one element (a scalar): a store or atomic is done by one thread, thread 0 (its own
  identity, not element 0 of a tile); a load is done by every thread of the program.
* Masked-off lanes do nothing.
* ``tl.debug_barrier()`` orders every access before it against every access after it within the
  program (a CTA ``bar.sync``). Nothing else does: in particular a reduction or scan (``tl.sum``,
  ``tl.cumsum``...) is NOT a barrier here. Triton lowers one through shared memory and ``bar.sync``
  only when the reduced tile spans more than one warp, which depends on the layout and
  ``num_warps``, neither of which the interpreter knows; code whose order rests on it is marked in
  its source (below) with that reason.
* Programs of one launch are unordered against each other; atomics are ordered against atomics
  (never flagged against each other), not against plain accesses.

What is flagged (a :class:`Hazard` each, grouped by kind and the two source sites)
----------------------------------------------------------------------------------
* ``X-WW`` / ``X-RW``: an address written non-atomically by one program and written / read by
  another program of the same launch; ``X-AT``: an address accessed atomically by one program and
  plainly by another.
* ``RAW`` / ``WAR`` / ``WAW``: within one program, an access by one thread after a conflicting
  access (at least one a write; atomics count as writes, two atomics never conflict) to the same
  address by another thread, with no barrier between.
* ``DUP-DIFF``: one plain store whose active lanes write one address with different values (the
  interpreter's "last lane wins" is not a GPU's). The same value twice (``DUP-SAME``) is counted,
  not flagged.

Addresses are element start addresses: two accesses of different widths that overlap without the
same start are not seen.

Accepted false positives are marked where they are: a comment ``# strict: benign, <reason>`` at the
end of either side's flagged line or alone on the line just above it, or the same on the line of a
call that leads to it (so one call site of a shared helper can be marked); the checker reads it from
the source. There is no allow-list.

Modes
-----
* ``detect``: execution unchanged; only records.
* ``perturb``: another legal schedule: a launch's programs run in reverse order (the program run
  k-th gets id ``G - 1 - k``), a store whose active lanes share an address is won by the first such
  lane, same-address atomics of one op are applied in reverse lane order.
* ``stale``: fault injection for missing barriers: a plain load of an address that another thread
  stored since the last barrier reads the value from before that store (a scalar load, done by
  every thread, reads it even in the storing thread: a worst case).
* ``lag``: the other half of a missing barrier, a lagging reader: a plain load that a later store by
  another thread (before the next barrier) overwrites reads the value of that store. Each launch
  runs twice from the same memory: the first run records, per program and per load (its dynamic
  index, site and address), the last such store's value; the second run returns it (for a scalar
  load in every thread: a worst case) and is the one whose results stand. Hazards come from the
  first run.
"""
from __future__ import annotations

import linecache
import os
import sys
from dataclasses import dataclass, field

import numpy as np
import triton
import triton.runtime.interpreter as _interp

MODES = ("detect", "perturb", "stale", "lag")
MARKER = "# strict: benign"
ALL = -1  # thread id of a scalar load: every thread of the program
T0 = 0  # thread id of a scalar store / atomic
_MULTI = -2

_TRITON_DIR = os.path.dirname(os.path.abspath(triton.__file__))
_THIS = os.path.abspath(__file__)
_LD, _ST, _AT = 0, 1, 2
_CLS = {_LD: "load", _ST: "store", _AT: "atomic"}

_STACK: list = []  # active checkers, innermost last (a self-test's checker shadows the plugin's)
_ORIG: dict = {}


def active() -> "Checker | None":
    return _STACK[-1] if _STACK else None


# ---- interpreter hooks ---------------------------------------------------------------------------
def _install() -> None:
    """Patch the interpreter once; the patches only forward unless a Checker is active."""
    if _ORIG:
        return
    B = _interp.InterpreterBuilder
    for name in ("create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas",
                 "create_atomic_load", "create_atomic_store", "create_barrier", "set_grid_idx"):
        _ORIG[name] = getattr(B, name)

    def create_masked_load(self, ptrs, mask, other, cache_policy, is_volatile):
        c = active()
        out = _ORIG["create_masked_load"](self, ptrs, mask, other, cache_policy, is_volatile)
        if c is not None and c._prog is not None and not c._inner:
            c._on_load(ptrs, mask, out)
        return out

    def create_masked_store(self, ptrs, value, mask, cache_policy):
        c = active()
        if c is None or c._prog is None or c._inner:
            return _ORIG["create_masked_store"](self, ptrs, value, mask, cache_policy)
        return c._on_store(self, ptrs, value, mask, cache_policy)

    def create_atomic_rmw(self, rmwOp, ptr, val, mask, sem, scope):
        c = active()
        if c is None or c._prog is None or c._inner:
            return _ORIG["create_atomic_rmw"](self, rmwOp, ptr, val, mask, sem, scope)
        return c._on_rmw(self, rmwOp, ptr, val, mask, sem, scope)

    def create_atomic_cas(self, ptr, cmp, val, sem, scope):
        c = active()
        if c is None or c._prog is None or c._inner:
            return _ORIG["create_atomic_cas"](self, ptr, cmp, val, sem, scope)
        return c._on_cas(self, ptr, cmp, val, sem, scope)

    def create_atomic_load(self, ptr, mask, sem, scope):  # tl.atomic_load: an atomic read
        c = active()
        if c is None or c._prog is None or c._inner:
            return _ORIG["create_atomic_load"](self, ptr, mask, sem, scope)
        c._inner += 1
        try:
            out = _ORIG["create_atomic_load"](self, ptr, mask, sem, scope)
        finally:
            c._inner -= 1
        c._record(_AT, ptr, mask)
        return out

    def create_atomic_store(self, ptr, val, mask, sem, scope):
        c = active()
        if c is None or c._prog is None or c._inner:
            return _ORIG["create_atomic_store"](self, ptr, val, mask, sem, scope)
        c._record(_AT, ptr, mask)
        c._inner += 1
        try:
            return _ORIG["create_atomic_store"](self, ptr, val, mask, sem, scope)
        finally:
            c._inner -= 1

    def create_barrier(self):
        c = active()
        if c is not None and c._prog is not None:
            c._barrier()
        return _ORIG["create_barrier"](self)

    def set_grid_idx(self, x, y, z):
        c = active()
        if c is not None and c._launch is not None:
            if c.mode == "perturb":
                gx, gy, gz = self.grid_dim
                x, y, z = gx - 1 - x, gy - 1 - y, gz - 1 - z
            c._new_program((x, y, z))
        return _ORIG["set_grid_idx"](self, x, y, z)

    for name, fn in (("create_masked_load", create_masked_load), ("create_masked_store", create_masked_store),
                     ("create_atomic_rmw", create_atomic_rmw), ("create_atomic_cas", create_atomic_cas),
                     ("create_atomic_load", create_atomic_load), ("create_atomic_store", create_atomic_store),
                     ("create_barrier", create_barrier), ("set_grid_idx", set_grid_idx)):
        setattr(B, name, fn)

    orig_call = _interp.GridExecutor.__call__
    _ORIG["GridExecutor.__call__"] = orig_call

    def __call__(self, *args, **kwargs):
        c = active()
        if c is None or c._launch is not None:
            return orig_call(self, *args, **kwargs)
        if c.mode == "lag":
            storages = {}
            for t in _tensors(args, kwargs):
                st = t.untyped_storage()
                storages.setdefault(st.data_ptr(), st)
            snap = [(st, st.clone()) for st in storages.values()]
            c._lag_pass, c._lag_subst = 1, {}
            c._begin_launch(self, args, kwargs)
            try:
                orig_call(self, *args, **kwargs)
            finally:
                c._end_launch()
            for st, old in snap:
                st.copy_(old)
            c._lag_pass = 2
        c._begin_launch(self, args, kwargs)
        try:
            return orig_call(self, *args, **kwargs)
        finally:
            c._end_launch()
            c._lag_pass = 0

    _interp.GridExecutor.__call__ = __call__


def _tensors(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if hasattr(v, "untyped_storage"):
            yield v
        elif isinstance(v, tuple):
            yield from _tensors(v, {})


def _flat(x, mask):
    """(flat int64 addresses of the active lanes, their flat lane indices, lane count)."""
    a = np.asarray(x.data)
    n = a.size
    a = a.reshape(-1).astype(np.int64, copy=False)
    if mask is None:
        return a, None, n
    m = np.asarray(mask.data)
    if m.shape != x.data.shape:
        m = np.broadcast_to(m, x.data.shape)
    m = m.reshape(-1)
    if m.all():
        return a, None, n
    k = np.flatnonzero(m)
    return a[k], k, n


# ---- records -------------------------------------------------------------------------------------
@dataclass
class Hazard:
    kind: str
    kernel: str
    a: tuple  # site of the earlier access: ((file, line, function), ...) outermost first
    b: tuple  # site of the later access (for DUP-DIFF: the store; a == b)
    a_cls: str
    b_cls: str
    grid: tuple = ()
    num_warps: int = 0
    count: int = 0  # addresses (cross-program, DUP) or lane pairs (intra-program)
    samples: list = field(default_factory=list)
    benign: str = ""  # the marker's reason when suppressed

    def describe(self) -> str:
        def site(s):
            if not s:
                return "?"
            f, ln, fn = s[-1]
            via = " via " + " <- ".join(f"{_short(f2)}:{l2}" for f2, l2, _ in reversed(s[:-1])) if len(s) > 1 else ""
            return f"{_short(f)}:{ln} ({fn}){via}"

        sides = (f"{self.a_cls} {site(self.a)}" if self.kind == "DUP-DIFF"
                 else f"{self.a_cls} {site(self.a)} -> {self.b_cls} {site(self.b)}")
        return (f"{self.kind} in {self.kernel} (grid {self.grid}, {self.num_warps} warps): {sides}; "
                f"{self.count} {'lane pairs' if self.kind in ('RAW', 'WAR', 'WAW') else 'addresses'}, "
                f"e.g. {', '.join(self.samples)}")


def _short(path: str) -> str:
    parts = path.replace("\\", "/").split("/")
    return "/".join(parts[-2:])


@dataclass
class _Launch:
    name: str
    grid: tuple
    num_warps: int
    spans: list  # (start, end, name, itemsize)
    recs: list = field(default_factory=list)  # cross-program: (addr array, program index, class, site)
    nprog: int = 0


class Checker:
    """Record interpreted launches inside ``with``; ``hazards()`` / ``unmarked()`` afterwards.
    ``mode``: ``detect``, ``perturb`` or ``stale`` (module docstring)."""

    def __init__(self, mode: str = "detect", only_loads=None):
        """``only_loads``: in stale / lag mode, change only loads whose innermost kernel line is one of
        these ``(path, line)`` (to test one pair); default every load."""
        self.only_loads = None if only_loads is None else {(str(p), int(n)) for p, n in only_loads}
        if mode not in MODES:
            raise ValueError(f"strict-gpu mode must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self._haz: dict = {}  # (kind, site a, site b, kernel) -> Hazard
        self.stats = dict(launches=0, programs=0, ops=0, dup_same=0, reversed_launches=0,
                          first_lane_stores=0, reversed_atomics=0, stale_lanes=0, lag_lanes=0)
        self._lag_pass = 0  # lag mode: 1 = the recording run, 2 = the run that returns the new values
        self._lag_subst: dict = {}
        self._launch = None
        self._prog = None
        self._inner = 0
        self._sites: dict = {}  # frame key -> site tuple
        self._marks: dict = {}  # (file, line) -> reason or ""
        self._shape_ns: dict = {}

    # context
    def __enter__(self):
        _install()
        _STACK.append(self)
        return self

    def __exit__(self, *exc):
        _STACK.remove(self)
        return False

    # results
    def hazards(self) -> list:
        return list(self._haz.values())

    def unmarked(self) -> list:
        return [h for h in self._haz.values() if not h.benign]

    def report(self, hazards=None) -> str:
        hs = self.unmarked() if hazards is None else hazards
        return "\n".join("  " + h.describe() for h in hs)

    # launches and programs
    def _begin_launch(self, gx, args, kwargs):
        grid = gx.grid if not callable(gx.grid) else ("fn",)
        spans = []

        def add(name, v):
            if hasattr(v, "data_ptr") and hasattr(v, "untyped_storage"):
                p = v.data_ptr()
                spans.append((p, p + v.numel() * v.element_size(), name, v.element_size()))
            elif isinstance(v, tuple):
                names = getattr(v, "_fields", None) or [str(i) for i in range(len(v))]
                for n, w in zip(names, v):
                    add(f"{name}.{n}", w)

        for n, v in zip(gx.arg_names, args):
            add(n, v)
        for n, v in kwargs.items():
            add(n, v)
        self._launch = _Launch(gx.fn.__name__, tuple(grid), int(kwargs.get("num_warps", 4)), spans)
        if self._lag_pass != 2:
            self.stats["launches"] += 1

    def _new_program(self, pid):
        self._prog = pid
        L = self._launch
        L.nprog += 1
        self._pidx = L.nprog - 1
        self.stats["programs"] += 1
        self._nld = 0
        self._reset_pending()

    def _reset_pending(self):
        # per class: a set of addresses (fast reject) and chunks (sorted addr, thread, site)
        self._pend = ([set(), []], [set(), []], [set(), []])
        self._stale: dict = {}  # addr -> (old value, storing thread or _MULTI)
        self._lag_loads: list = []  # lag mode, first run: (load index, site, addresses, threads)

    def _end_launch(self):
        L = self._launch
        self._launch = None
        self._prog = None
        if self._lag_pass == 2:
            return
        if L.nprog > 1:
            if self.mode == "perturb":
                self.stats["reversed_launches"] += 1
            self._cross(L)

    def _barrier(self):
        self._reset_pending()

    # sites and markers
    def _site(self):
        f = sys._getframe(1)
        key = []
        stop = _ORIG["GridExecutor.__call__"].__code__
        while f is not None:
            co = f.f_code
            if co is stop:
                break
            fn = co.co_filename
            if not fn.startswith(_TRITON_DIR) and fn != _THIS and not fn.startswith("<"):
                key.append((fn, f.f_lineno, co.co_name))
            f = f.f_back
        key = tuple(reversed(key))
        s = self._sites.get(key)
        if s is None:
            s = self._sites[key] = key
        return s

    def _mark(self, site) -> str:
        for fn, ln, _ in site:
            k = (fn, ln)
            r = self._marks.get(k)
            if r is None:
                line = linecache.getline(fn, ln)
                above = linecache.getline(fn, ln - 1).strip()
                if MARKER not in line and above.startswith(MARKER):
                    line = above
                i = line.find(MARKER)
                r = self._marks[k] = line[i + len(MARKER):].lstrip(" ,:").strip() or "benign" if i >= 0 else ""
            if r:
                return r
        return ""

    def _name(self, addr: int) -> str:
        for lo, hi, n, sz in self._launch.spans if self._launch else ():
            if lo <= addr < hi:
                return f"{n}[{(addr - lo) // sz}]"
        return hex(addr)

    def _add(self, kind, a, b, ca, cb, count, addrs):
        L = self._launch
        key = (kind, a, b, L.name)
        h = self._haz.get(key)
        if h is None:
            h = self._haz[key] = Hazard(kind, L.name, a, b, _CLS[ca], _CLS[cb], L.grid, L.num_warps)
            h.benign = self._mark(a) or self._mark(b)
        h.count += count
        if len(h.samples) < 3:
            for x in addrs[:3 - len(h.samples)]:
                h.samples.append(self._name(int(x)))

    # thread ids
    def _tids(self, n, k, cls):
        if n == 1:
            return ALL if cls == _LD else T0
        ns = self._shape_ns.setdefault(n, len(self._shape_ns) + 1)
        base = ns << 32
        if k is None:
            return np.arange(base, base + n, dtype=np.int64)
        return k.astype(np.int64) + base

    # intra-program accesses
    def _record(self, cls, ptr, mask, site=None):
        a, k, n = _flat(ptr, mask)
        if self._lag_pass == 2:
            return a, k, n
        self.stats["ops"] += 1
        if a.size == 0:
            return a, k, n
        site = site or self._site()
        t = self._tids(n, k, cls)
        self._check(cls, a, t, site)
        self._insert(cls, a, t, site)
        if self._launch_multi():
            self._launch.recs.append((a, self._pidx, cls, site))
        return a, k, n

    def _launch_multi(self):
        g = _interp.interpreter_builder.grid_dim
        return g[0] * g[1] * g[2] > 1

    def _check(self, cls, a, t, site):
        against = ((_ST, "RAW"), (_AT, "RAW")) if cls == _LD else \
            ((_LD, "WAR"), (_ST, "WAW"), (_AT, "WAW")) if cls == _ST else ((_LD, "WAR"), (_ST, "WAW"))
        keys = None
        for oc, kind in against:
            addrs, chunks = self._pend[oc]
            if not addrs:
                continue
            if keys is None:
                keys = a.tolist()
            if addrs.isdisjoint(keys):
                continue
            for ca, ct, csite in chunks:
                hit = np.isin(a, ca)
                if not hit.any():
                    continue
                ah = a[hit]
                lo = np.searchsorted(ca, ah, "left")
                hi = np.searchsorted(ca, ah, "right")
                if isinstance(ct, np.ndarray):
                    if isinstance(t, np.ndarray):
                        tt = t[hit]
                        bad = (hi - lo > 1) | (ct[lo] != tt)
                    else:
                        bad = np.ones(ah.size, bool)  # a scalar access vs a tile's threads
                else:
                    if isinstance(t, np.ndarray):
                        bad = np.ones(ah.size, bool)
                    else:
                        bad = np.full(ah.size, ct == ALL or t == ALL or ct != t)
                if bad.any():
                    self._add(kind, csite, site, oc, cls, int(bad.sum()), ah[bad])

    def _insert(self, cls, a, t, site):
        addrs, chunks = self._pend[cls]
        addrs.update(a.tolist())
        if isinstance(t, np.ndarray) and a.size > 1:
            o = np.argsort(a, kind="stable")
            chunks.append((a[o], t[o], site))
        else:
            chunks.append((a, t, site))

    # ops
    def _on_load(self, ptrs, mask, out):
        if self.mode == "lag":
            return self._lag_load(ptrs, mask, out)
        a, k, n = self._record(_LD, ptrs, mask)
        if self.mode == "stale" and self._stale and a.size and self._chosen():
            t = self._tids(n, k, _LD)
            data = out.data
            flat = data.reshape(-1)
            idx = np.arange(n) if k is None else k
            for j, (addr, lane) in enumerate(zip(a.tolist(), idx.tolist())):
                e = self._stale.get(addr)
                if e is None:
                    continue
                old, who = e
                me = t if not isinstance(t, np.ndarray) else int(t[j])
                if me == ALL or who == _MULTI or who != me:
                    if old.dtype.itemsize == flat.dtype.itemsize:
                        flat[lane] = old.view(flat.dtype)[0]
                        self.stats["stale_lanes"] += 1
            if not np.shares_memory(flat, data):
                out.data = flat.reshape(data.shape)

    def _on_store(self, b, ptrs, value, mask, cache_policy):
        if self._lag_pass == 2:
            return _ORIG["create_masked_store"](b, ptrs, value, mask, cache_policy)
        site = self._site()
        a, k, n = self._record(_ST, ptrs, mask, site)
        if a.size > 1:
            u, first, cnt = np.unique(a, return_index=True, return_counts=True)
            if u.size < a.size:
                self._dup(a, k, n, value, u, first, cnt, site)
                if self.mode == "perturb":
                    keep = np.zeros(n, bool)
                    keep[(k[first] if k is not None else first)] = True
                    mask = _interp.TensorHandle(keep.reshape(ptrs.data.shape), mask.dtype)
                    self.stats["first_lane_stores"] += 1
        if self.mode == "stale" and a.size:
            dt = np.asarray(value.data).dtype
            oldv = np.asarray(_interp._interpreter.load(
                ptrs.data, np.broadcast_to(mask.data, ptrs.data.shape),
                np.zeros(ptrs.data.shape, dt), dt)).reshape(-1)
            idx = np.arange(n) if k is None else k
            t = self._tids(n, k, _ST)
            for j, (addr, lane) in enumerate(zip(a.tolist(), idx.tolist())):
                me = t if not isinstance(t, np.ndarray) else int(t[j])
                e = self._stale.get(addr)
                if e is None:
                    self._stale[addr] = (oldv[lane:lane + 1].copy(), me)
                elif e[1] != me:
                    self._stale[addr] = (e[0], _MULTI)
        if self._lag_pass == 1 and a.size and self._lag_loads:
            self._lag_store(a, k, n, value)
        return _ORIG["create_masked_store"](b, ptrs, value, mask, cache_policy)

    def _chosen(self):
        if self.only_loads is None:
            return True
        s = self._site()
        return bool(s) and s[-1][:2] in self.only_loads

    # lag mode
    def _lag_load(self, ptrs, mask, out):
        site = self._site()
        a, k, n = self._record(_LD, ptrs, mask, site)
        i = self._nld
        self._nld += 1
        if not a.size:
            return
        t = self._tids(n, k, _LD)
        if self._lag_pass == 1:
            if self.only_loads is None or site and site[-1][:2] in self.only_loads:
                self._lag_loads.append((i, site, a, t, k, n))
            return
        e = self._lag_subst.get((self._prog, i))
        if e is None or e[0] != site:
            return
        new = e[1]
        data = out.data
        flat = data.reshape(-1)
        idx = np.arange(n) if k is None else k
        for j, (addr, lane) in enumerate(zip(a.tolist(), idx.tolist())):
            v = new.get(addr)
            if v is None:
                continue
            val, who = v
            me = t if not isinstance(t, np.ndarray) else int(t[j])
            if (me == ALL or who != me) and val.dtype.itemsize == flat.dtype.itemsize:
                flat[lane] = val.view(flat.dtype)[0]
                self.stats["lag_lanes"] += 1
        if not np.shares_memory(flat, data):
            out.data = flat.reshape(data.shape)

    def _lag_store(self, a, k, n, value):
        v = np.broadcast_to(np.asarray(value.data), (n,) if np.asarray(value.data).size != 1 else (1,))
        v = v.reshape(-1)
        vals = v if v.size == 1 else (v if k is None else v[k])
        ts = self._tids(n, k, _ST)
        pos = {addr: j for j, addr in enumerate(a.tolist())}  # the last lane of an address wins
        for i, site, la, lt, lk, ln in self._lag_loads:
            hit = np.flatnonzero(np.isin(la, a))
            if not hit.size:
                continue
            e = self._lag_subst.setdefault((self._prog, i), (site, {}))
            for h in hit.tolist():
                addr = int(la[h])
                j = pos[addr]
                who = ts if not isinstance(ts, np.ndarray) else int(ts[j])
                me = lt if not isinstance(lt, np.ndarray) else int(lt[h])
                if me == ALL or me != who:
                    e[1][addr] = (vals[0 if vals.size == 1 else j:][:1].copy(), who)

    def _dup(self, a, k, n, value, u, first, cnt, site):
        v = np.asarray(value.data).reshape(-1)
        if v.size == 1:
            self.stats["dup_same"] += 1
            return
        v = v if k is None else v[k]
        vb = v.view(np.dtype(f"u{v.dtype.itemsize}")) if v.dtype.itemsize in (1, 2, 4, 8) else v
        inv = np.searchsorted(u, a)
        ref = vb[first][inv]
        diff = np.zeros(u.size, bool)
        np.logical_or.at(diff, inv, vb != ref)
        if diff.any():
            self._add("DUP-DIFF", site, site, _ST, _ST, int(diff.sum()), u[diff])
        else:
            self.stats["dup_same"] += 1

    def _reverse_call(self, fn, handles):
        """Call ``fn`` with the lanes of the TensorHandles ``handles`` (by position) reversed."""
        rev = []
        for h in handles:
            if isinstance(h, _interp.TensorHandle) and np.asarray(h.data).size > 1:
                d = np.asarray(h.data)
                rev.append(_interp.TensorHandle(np.ascontiguousarray(d.reshape(-1)[::-1]).reshape(d.shape), h.dtype))
            else:
                rev.append(h)
        out = fn(*rev)
        d = out.data
        out.data = np.ascontiguousarray(d.reshape(-1)[::-1]).reshape(d.shape)
        return out

    def _dups(self, a):
        return a.size > 1 and np.unique(a).size < a.size

    def _on_rmw(self, b, rmwOp, ptr, val, mask, sem, scope):
        a, _, _ = self._record(_AT, ptr, mask)
        fn = _ORIG["create_atomic_rmw"]
        if self.mode == "perturb" and self._dups(a):
            self.stats["reversed_atomics"] += 1
            return self._reverse_call(lambda p, v, m: fn(b, rmwOp, p, v, m, sem, scope), (ptr, val, mask))
        return fn(b, rmwOp, ptr, val, mask, sem, scope)

    def _on_cas(self, b, ptr, cmp, val, sem, scope):
        a, _, _ = self._record(_AT, ptr, None)
        fn = _ORIG["create_atomic_cas"]
        if self.mode == "perturb" and self._dups(a):
            self.stats["reversed_atomics"] += 1
            return self._reverse_call(lambda p, c, v: fn(b, p, c, v, sem, scope), (ptr, cmp, val))
        return fn(b, ptr, cmp, val, sem, scope)

    # cross-program
    def _cross(self, L):
        if not L.recs:
            return
        # programs per address per class; only addresses some program writes matter
        rows = []
        for i, (a, p, cls, site) in enumerate(L.recs):
            rows.append((np.unique(a), p, cls, i))
        w = [r[0] for r in rows if r[2] != _LD]
        if not w:
            return
        waddr = np.unique(np.concatenate(w))
        per = {}  # addr -> list of (prog, cls, site index)
        seen_site = {}
        for ua, p, cls, i in rows:
            h = ua[np.isin(ua, waddr)]
            if not h.size:
                continue
            site = L.recs[i][3]
            sid = seen_site.setdefault(site, len(seen_site))
            for x in h.tolist():
                per.setdefault(x, set()).add((p, cls, sid))
        sites = {v: k for k, v in seen_site.items()}
        pairs = {}
        for x, acc in per.items():
            if len({p for p, _, _ in acc}) < 2:
                continue
            acc = sorted(acc)
            for i1 in range(len(acc)):
                p1, c1, s1 = acc[i1]
                for i2 in range(i1 + 1, len(acc)):
                    p2, c2, s2 = acc[i2]
                    if p1 == p2:
                        continue
                    if c1 == _AT and c2 == _AT or c1 == _LD and c2 == _LD:
                        continue
                    if _AT in (c1, c2):
                        kind = "X-AT"
                    elif c1 == _ST and c2 == _ST:
                        kind = "X-WW"
                    else:
                        kind = "X-RW"
                    k = (kind, min((c1, s1), (c2, s2)), max((c1, s1), (c2, s2)))
                    pairs.setdefault(k, set()).add(x)
        saved = self._launch
        self._launch = L
        try:
            for (kind, (c1, s1), (c2, s2)), xs in pairs.items():
                self._add(kind, sites[s1], sites[s2], c1, c2, len(xs), sorted(xs))
        finally:
            self._launch = saved
