"""The default model requantized by llama.cpp's own quantizer (`llama_model_quantize`, the
function behind llama-quantize), for tests/e2e/reference.rs and tests/reference/regen.

    python3 requantize.py SOURCE_GGUF OUT_DIR

Writes SmolLM2-135M-Instruct.{Q4_K_M,Q5_K_M,Q6_K}.gguf into OUT_DIR. The quantizer comes from
the llama-cpp-cffi wheel on PyPI (a CPU build of llama.cpp; tests/run installs it), so CI gets
llama-quantize's files in seconds without building llama.cpp. The bytes equal those of the
llama-quantize that tests/bench/build-llama-cpp builds from the llama-cpp-python sdist (checked
when the reference data was made; the tests check the files' sha256 against it).

The wheel was built with GCC 14, whose C++ runtime has `__cxa_call_terminate`; Debian 12's
libstdc++ (GCC 12) does not, so a one-function shim (calling abort, as std::terminate does
by default) is compiled with cc and loaded first."""
import ctypes
import importlib.util
import os
import subprocess
import sys

# llama_ftype values (llama.h).
TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q6_K": 18}
SHIM = "#include <stdlib.h>\nvoid __cxa_call_terminate(void *e) { (void)e; abort(); }\n"


def quantizer(work):
    shim_c, shim = os.path.join(work, "shim.c"), os.path.join(work, "libshim.so")
    with open(shim_c, "w") as f:
        f.write(SHIM)
    subprocess.run(["cc", "-shared", "-fPIC", "-o", shim, shim_c], check=True)
    ctypes.CDLL(shim, mode=ctypes.RTLD_GLOBAL)
    # The extension module alone: the package's __init__ pulls in what this does not need.
    pkg = importlib.util.find_spec("llama")
    if pkg is None or not pkg.submodule_search_locations:
        sys.exit("requantize.py: the llama-cpp-cffi wheel is not installed (tests/run installs it)")
    folder = list(pkg.submodule_search_locations)[0]
    so = [n for n in os.listdir(folder) if n.startswith("_llama_cpp_cpu") and n.endswith(".so")][0]
    spec = importlib.util.spec_from_file_location("_llama_cpp_cpu", os.path.join(folder, so))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.lib, module.ffi


def main():
    src, out = sys.argv[1], sys.argv[2]
    os.makedirs(out, exist_ok=True)
    lib, ffi = quantizer(out)
    for name, ftype in TYPES.items():
        params = lib.llama_model_quantize_default_params()
        params.ftype = ftype
        params.allow_requantize = True
        params.nthread = 2
        dst = os.path.join(out, f"SmolLM2-135M-Instruct.{name}.gguf")
        rc = lib.llama_model_quantize(src.encode(), dst.encode(), ffi.new("llama_model_quantize_params *", params))
        if rc != 0:
            sys.exit(f"requantize.py: llama_model_quantize returned {rc} for {name}")
        print(dst)


if __name__ == "__main__":
    main()
