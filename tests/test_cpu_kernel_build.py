"""How the CPU kernel library is put together (batchrun/kernels/cpu/__init__.py): one library from every C
file of csrc/, cached by all of its sources, and a Python module per kernel family that declares exactly the
kernels of its C file."""

import re
import shutil

import pytest

from batchrun.kernels import cpu as cpu_kernels
from batchrun.kernels.cpu import attention, decoder, elementwise, gptq, linears, logits, moe, quant, sampling

FAMILIES = {"attention": attention, "elementwise": elementwise, "sampling": sampling, "linears": linears,
            "quant_linears": quant, "gptq": gptq, "logits": logits, "decoder": decoder, "moe": moe}


def _exported(c_source: str) -> set[str]:
    """The functions a C file defines outside `static` (a definition's type starts its line)."""
    return set(re.findall(r"^(?:int|int64_t|void|float)\s+\**(\w+)\(", c_source, flags=re.M))


def test_each_family_module_declares_the_kernels_of_its_c_file():
    files = cpu_kernels.sources()
    assert set(files) == {"common.h", "common.c", *(f"{name}.c" for name in FAMILIES)}
    for name, module in FAMILIES.items():
        assert _exported(files[f"{name}.c"].decode()) == set(module.SIGNATURES), name
    # common.c exports nothing to Python: amx_allowed is hidden inside the library
    assert _exported(files["common.c"].decode()) == {"amx_allowed"}
    assert 'visibility("hidden"))) int amx_allowed(void);' in files["common.h"].decode()


def test_the_cache_key_covers_every_source_and_header_and_the_compiler():
    files = {"common.h": b"#define X 1\n", "a.c": b'#include "common.h"\nint a(void) { return X; }\n'}
    key = cpu_kernels._cache_key(files, "cc")
    assert cpu_kernels._cache_key(dict(files), "cc") == key
    assert cpu_kernels._cache_key({**files, "common.h": b"#define X 2\n"}, "cc") != key  # a header alone
    assert cpu_kernels._cache_key({**files, "b.c": b"int b(void) { return 0; }\n"}, "cc") != key
    assert cpu_kernels._cache_key({"common.h": files["common.h"], "b.c": files["a.c"]}, "cc") != key  # renamed
    assert cpu_kernels._cache_key(files, "gcc") != key


def test_the_build_target_replaces_native_and_is_part_of_the_cache_key(monkeypatch):
    files = {"a.c": b"int a(void) { return 1; }\n"}
    monkeypatch.delenv("BATCHRUN_CPU_MARCH", raising=False)
    assert "-march=native" in cpu_kernels._flags()
    native = cpu_kernels._cache_key(files, "cc")
    assert cpu_kernels._cache_key(files, "cc", cpu_kernels._flags("native")) == native
    flags = cpu_kernels._flags("x86-64-v3")
    assert "-march=x86-64-v3" in flags and "-march=native" not in flags
    assert cpu_kernels._cache_key(files, "cc", flags) != native
    monkeypatch.setenv("BATCHRUN_CPU_MARCH", "x86-64-v3")
    assert cpu_kernels._flags() == flags and cpu_kernels._cache_key(files, "cc") != native


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_build_links_every_c_file_into_one_library(tmp_path, monkeypatch):
    import ctypes

    monkeypatch.setenv("BATCHRUN_CACHE", str(tmp_path))
    files = {
        "common.h": b"static inline int twice(int x) { return 2 * x; }\n",
        "a.c": b'#include "common.h"\nint from_a(int x) { return twice(x) + 1; }\n',
        "b.c": b'#include "common.h"\nint from_b(int x) { return twice(x) + 2; }\n',
    }
    signatures = {"from_a": (ctypes.c_int, [ctypes.c_int]), "from_b": (ctypes.c_int, [ctypes.c_int])}
    lib = cpu_kernels.build(files, signatures)
    assert lib.from_a(20) == 41 and lib.from_b(20) == 42
    assert len(list((tmp_path / "kernels").glob("*.so"))) == 1  # and no work files left behind
    assert list((tmp_path / "kernels").iterdir()) == list((tmp_path / "kernels").glob("*.so"))
    assert cpu_kernels.build({**files, "b.c": b"int from_b(int x) { return x +; }\n"}, signatures) is None
