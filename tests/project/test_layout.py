"""The tree's layout rules (docs: README "Layout"): kernels take their state as NamedTuples (no
``@triton.jit`` function with more than 16 parameters), launches happen only in ``kernels/``, and the
device path never imports the reference pool."""
from harness.paths import ROOT
import ast

import pytest

MAX_JIT_PARAMS = 16
DEVICE_PATH = ["src/gpupool/pool.py", "src/gpupool/state.py", "src/gpupool/manager.py", "src/gpupool/graph.py",
               "src/gpupool/validate.py", "src/gpupool/args.py", "src/gpupool/errors.py", "src/gpupool/groups.py",
               "src/gpupool/reservations.py", "src/gpupool/kv_cache.py"]


def _jit_functions():
    for path in sorted((ROOT / "src" / "gpupool" / "kernels").rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).startswith(("triton.jit", "jit")) for d in node.decorator_list):
                yield path.name, node


def test_kernels_are_found():
    assert len(list(_jit_functions())) > 40


@pytest.mark.parametrize("limit", [MAX_JIT_PARAMS])
def test_no_jit_function_takes_more_than_16_parameters(limit):
    wide = {f"{name}::{fn.name}": len(fn.args.args) for name, fn in _jit_functions() if len(fn.args.args) > limit}
    assert not wide, f"@triton.jit functions over {limit} parameters (pass state as a NamedTuple): {wide}"


def test_kernels_are_launched_only_from_kernels():
    """``kernel[grid](...)`` appears only in kernels/ (each kernel has a launcher beside it)."""
    launches = []
    kernels = ROOT / "src" / "gpupool" / "kernels"
    for path in sorted(p for p in (ROOT / "src" / "gpupool").rglob("*.py") if not p.is_relative_to(kernels)):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Subscript)
                    and ast.unparse(node.func.value).endswith("_kernel")):
                launches.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not launches, f"launches outside kernels/: {launches}"


@pytest.mark.parametrize("rel", DEVICE_PATH)
def test_device_path_does_not_import_the_reference(rel):
    tree = ast.parse((ROOT / rel).read_text())
    mods = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    mods += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert not [m for m in mods if "reference" in m], f"{rel} imports the reference: {mods}"


def _mirrors():
    from gpupool.errors import ErrorCode
    from gpupool.kernels import layout, replay, validate

    return [(layout, layout.Ctrl, ""), (layout, layout.Status, "ST_"), (layout, layout.Cause, "C_"),
            (layout, layout.Op, "OP_"),
            (layout, ErrorCode, "E_"), (layout, layout.Event, "EV_"), (layout, layout.EventCol, "EC_"),
            (layout, layout.KeyCol, "K_"), (layout, layout.RoundField, "RF_"), (layout, layout.Confirm, "CF_"),
            (layout, layout.Fallback, "R_"), (layout, layout.KindCode, "KIND_"), (replay, replay.LoopWord, "W_"),
            (validate, validate.Check, "V_")]


@pytest.mark.parametrize("module, enum, prefix", _mirrors(), ids=lambda v: getattr(v, "__name__", v))
def test_every_constexpr_mirror_equals_its_member(module, enum, prefix):
    """The names unpacked from ``layout.constexprs(enum)`` must follow the members' order."""
    wrong = {prefix + m.name: getattr(module, prefix + m.name, None) for m in enum
             if getattr(getattr(module, prefix + m.name, None), "value", None) != int(m)}
    assert not wrong, f"{module.__name__}: mirrors that differ from {enum.__name__}: {wrong}"


def test_the_read_apis_columns_are_where_the_layout_names_them():
    """``BlockPool.mirror_rows`` and ``counters`` against the pool's own getters, column by name
    (``kernels/layout.py``'s MirrorCol, MirrorKey, Counter); Counter follows Ctrl's order from NUM_FREE."""
    import torch

    from gpupool.kernels.layout import MIRROR_KEY_WIDTH, Counter, Ctrl, KeyCol, MirrorCol, MirrorKey
    from harness.keys import h
    from harness.twins import pool_twin

    assert [c.name for c in Counter][1:] == [c.name for c in Ctrl if Ctrl.NUM_FREE <= c <= Ctrl.REUSE_COUNT]
    assert [k.name for k in MirrorKey] == ["HI", "LO", "SEQ"] and KeyCol.LO == KeyCol.HI + 1
    assert MirrorCol.KEYS == len(MirrorCol) - 1
    _, pool = pool_twin(12, max_keys_per_block=2, enable_kv_cache_events=True)
    blocks = pool.get_new_blocks(4).tolist()
    pool.cache_full_blocks(blocks[:3], [h(1), h(2), h(3)], 0, 3, 16, 0)
    pool.cache_partial_block(blocks[0], [h(7), h(8), h(9), h(10)], 16, 1, 16, 4)  # a second key on the first block
    pool.free_blocks(blocks[2:])
    rows = pool.mirror_rows(torch.tensor(blocks)).tolist()
    for b, row in zip(blocks, rows):
        assert row[MirrorCol.REF_CNT] == pool.ref_counts([b])[0]
        assert row[MirrorCol.NUM_KEYS] == len(pool.block_keys(b))
        assert row[MirrorCol.HASH_NTOK] == (pool.block_hash_num_tokens(b) or -1)
        slots = [row[MirrorCol.KEYS + MIRROR_KEY_WIDTH * j:][:MIRROR_KEY_WIDTH] for j in range(row[MirrorCol.NUM_KEYS])]
        assert [pool.key_name((s[MirrorKey.HI], s[MirrorKey.LO])) for s in slots] == pool.block_keys(b)
    seqs = [rows[0][MirrorCol.KEYS + MirrorKey.SEQ], rows[1][MirrorCol.KEYS + MirrorKey.SEQ],
            rows[0][MirrorCol.KEYS + MIRROR_KEY_WIDTH + MirrorKey.SEQ]]
    assert seqs == sorted(seqs) and len(set(seqs)) == 3  # insertion order: block 0, block 1, block 0's second key
    counters = pool.counters().tolist()
    assert counters[Counter.ERROR_CODE] == 0
    assert counters[Counter.NUM_FREE] == pool.get_num_free_blocks()
    assert counters[Counter.KEY_SEQ] == max(seqs) + 1  # the next insertion's number
    assert counters[Counter.EV_COUNT] == counters[Counter.REUSE_COUNT] == 0  # drained by each op
