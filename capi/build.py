"""Build libvengine.so, the C ABI of vengine (cffi embedding mode).

    python -m capi.build [--out DIR] [--verbose]

writes ``DIR/libvengine.so`` (default ``<repo>/build/capi/libvengine.so``) and prints
its path. ``build(out_dir)`` does the same from Python and returns the path.

What is baked in at build time (each overridable at run time):

- the Python executable whose site-packages hold torch (``sys.executable`` of the
  interpreter running this build; ``VENGINE_PYTHON`` overrides it),
- the source root put on the embedded ``sys.path`` so ``capi`` and ``pyengine`` import
  (this checkout; ``VENGINE_PYTHONPATH``, ``os.pathsep``-separated, overrides it),
- libpython's soname (re-opened ``RTLD_GLOBAL`` by a library constructor) and an rpath
  to its directory.

Needs cffi, a C compiler (``CC``, default ``gcc``) and the Python headers and shared
libpython of the building interpreter.
"""
from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
# A source checkout has include/vllm.h; an installed wheel carries a copy inside capi/.
HEADER = next((h for h in (ROOT / "include" / "vllm.h", HERE / "vllm.h") if h.is_file()),
              ROOT / "include" / "vllm.h")
C_SOURCE = HERE / "vengine_capi.c"
MODULE = "_vengine_cffi"
LIB_NAME = "libvengine.so"
DEFAULT_OUT = ROOT / "build" / "capi"
VERSION = "0.1.0"

# What Python sees of the C side: the parameter structs (taken verbatim from the
# header so there is one source of truth), the per-step delta batch, and the
# functions implemented in Python (capi/_impl.py).
_CDEF_TAIL = r"""
typedef struct vg_delta {
  void* req;
  const char* text;
  int64_t text_len;
  const int32_t* token_ids;
  int32_t n_tokens;
  int32_t finished;
  int32_t status;
  int32_t prompt_tokens;
  const char* finish_reason;
  const char* error;
} vg_delta;

void vg_push(const vg_delta* d, int32_t n);

extern "Python" int32_t _vg_py_ready(char* err, int32_t errlen);
extern "Python" int32_t _vg_py_load(const vllm_model_params* p, int64_t* eng_id,
                                    char* model_name, int32_t namelen, char* err, int32_t errlen);
extern "Python" int32_t _vg_py_submit(int64_t eng_id, void* req, uint64_t num, const char* prompt,
                                      const int32_t* toks, int32_t ntoks,
                                      const vllm_sampling_params* sp, char* err, int32_t errlen);
extern "Python" int32_t _vg_py_submit_chat(int64_t eng_id, void* req, uint64_t num,
                                           const char* json, int32_t stream, char* err,
                                           int32_t errlen);
extern "Python" int32_t _vg_py_default_params(int64_t eng_id, vllm_sampling_params* out, char* err,
                                              int32_t errlen);
extern "Python" void _vg_py_abort(int64_t eng_id, const uint64_t* nums, int32_t n);
extern "Python" void _vg_py_poll(int64_t eng_id);
extern "Python" void _vg_py_engine_free(int64_t eng_id);
"""

# Runs once, inside the embedded interpreter, the first time the library needs Python.
# Any failure is kept and reported by _vg_py_ready (so vllm_engine_load can return it as
# an error message) instead of leaving cffi's exports to return 0 (== VLLM_OK).
_INIT_CODE = r"""
import os as _os, sys as _sys
_paths = _os.environ.get("VENGINE_PYTHONPATH") or {root!r}
for _p in reversed([p for p in _paths.split(_os.pathsep) if p]):
    if _p not in _sys.path:
        _sys.path.insert(0, _p)
from {module} import ffi, lib
_init_error = None
try:
    from capi import _impl
    _impl.install(ffi, lib)
except BaseException:
    import traceback as _tb
    _init_error = _tb.format_exc()

@ffi.def_extern(error=0)
def _vg_py_ready(err, errlen):
    if _init_error is None:
        return 1
    msg = _init_error.encode("utf-8", "replace")[: max(errlen - 1, 0)]
    ffi.memmove(err, msg + b"\0", len(msg) + 1)
    return 0
"""


def _cdef() -> str:
    header = HEADER.read_text()
    parts = []
    for pat in (r"typedef struct vllm_model_params \{.*?\} vllm_model_params;",
                r"typedef void \(\*vllm_logits_processor\)\(.*?\);",
                r"typedef struct vllm_sampling_params \{.*?\} vllm_sampling_params;"):
        m = re.search(pat, header, re.S)
        if not m:
            raise RuntimeError(f"capi.build: {pat!r} not found in {HEADER}")
        parts.append(m.group(0))
    return "\n".join(parts) + _CDEF_TAIL


def _libpython():
    libdir = sysconfig.get_config_var("LIBDIR")
    soname = sysconfig.get_config_var("INSTSONAME") or sysconfig.get_config_var("LDLIBRARY")
    ldlib = sysconfig.get_config_var("LDLIBRARY") or ""
    if not ldlib.endswith(".so") and ".so." not in ldlib:
        raise RuntimeError(f"capi.build: this Python has no shared libpython ({ldlib!r}); "
                           "cffi embedding needs one (build Python with --enable-shared).")
    name = re.sub(r"^lib|\.so.*$", "", ldlib)
    return libdir, soname, name


def build(out_dir: str | os.PathLike | None = None, verbose: bool = False) -> Path:
    """Generate the cffi embedding C code and compile it into ``out_dir/libvengine.so``."""
    import importlib.util

    import cffi

    # The library embeds *this* interpreter: without torch it would build fine and then
    # fail at every vllm_engine_load.
    missing = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        raise RuntimeError(f"capi.build: {sys.executable} cannot import {', '.join(missing)}; build with "
                           "the Python that runs the engine (e.g. .venv/bin/python -m capi.build).")
    out_dir = Path(out_dir) if out_dir else DEFAULT_OUT
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIB_NAME
    libdir, soname, pyname = _libpython()

    ffi = cffi.FFI()
    ffi.cdef(_cdef())
    ffi.embedding_init_code(_INIT_CODE.format(root=str(ROOT), module=MODULE))
    defines = (f'#define VG_PYTHON_EXECUTABLE "{_c_escape(sys.executable)}"\n'
               f'#define VG_LIBPYTHON_SONAME "{_c_escape(soname)}"\n'
               f'#define VG_VERSION "{VERSION}"\n')
    ffi.set_source(MODULE, defines + C_SOURCE.read_text())

    with tempfile.TemporaryDirectory(prefix="vengine-capi-") as tmp:
        c_file = Path(tmp) / f"{MODULE}.c"
        ffi.emit_c_code(str(c_file))
        version_script = Path(tmp) / "exports.map"
        version_script.write_text("{ global: vllm_*; PyInit_" + MODULE + "; local: *; };\n")
        tmp_target = Path(tmp) / LIB_NAME
        cc = shlex.split(os.environ.get("CC", "gcc"))
        cmd = cc + [
            "-shared", "-fPIC", "-O2", "-g", "-pthread", "-fvisibility=hidden",
            "-Wall", "-Wno-unused-function", "-Wno-unused-parameter",
            "-I", str(HEADER.parent), "-I", sysconfig.get_paths()["include"],
            str(c_file), "-o", str(tmp_target),
            f"-L{libdir}", f"-l{pyname}", f"-Wl,-rpath,{libdir}",
            "-Wl,-z,nodelete", f"-Wl,--version-script={version_script}", "-ldl",
        ]
        if verbose:
            print(" ".join(shlex.quote(c) for c in cmd), file=sys.stderr)
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0 or (verbose and proc.stderr):
            print(proc.stdout + proc.stderr, file=sys.stderr)
        if proc.returncode != 0:
            raise RuntimeError(f"capi.build: compiling {LIB_NAME} failed (exit {proc.returncode})")
        staged = out_dir / f".{LIB_NAME}.{os.getpid()}.tmp"
        shutil.copyfile(tmp_target, staged)
        os.replace(staged, target)  # atomic: a running host keeps its old mapping
    return target


def _c_escape(s: str) -> str:
    return s.replace("\\", "\\\\").replace('"', '\\"')


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help=f"output directory (default {DEFAULT_OUT})")
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    print(build(args.out, args.verbose))
    return 0


if __name__ == "__main__":
    sys.exit(main())
