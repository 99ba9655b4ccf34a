# Sourced by the scripts that build llama.cpp from source (tests/build-llama-server,
# tests/bench/build-llama-cpp): puts cmake and ninja on PATH, installed from PyPI into
# "$root/build-tools" when the system has neither. Expects `root` (the cache directory); sets
# `pip` and `build_tools`.
pip=(python3 -m pip)
"${pip[@]}" --version >/dev/null 2>&1 || pip=(pip3)
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  build_tools="$root/build-tools"
  if [ ! -x "$build_tools/bin/cmake" ] || [ ! -x "$build_tools/bin/ninja" ]; then
    "${pip[@]}" install --quiet --target "$build_tools" cmake==4.1.2 ninja==1.13.0 >&2 ||
      "${pip[@]}" install --quiet --break-system-packages --target "$build_tools" cmake==4.1.2 ninja==1.13.0 >&2
  fi
  export PATH="$build_tools/bin:$PATH" PYTHONPATH="$build_tools${PYTHONPATH:+:$PYTHONPATH}"
fi
