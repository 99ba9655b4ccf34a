# Sourced by the scripts that build llama.cpp from source (tests/build-llama-server,
# tests/bench/build-llama-cpp): puts cmake and ninja on PATH, installed from PyPI into
# "$root/build-tools" when the system has neither. Expects `root` (the cache directory).
pip=(python3 -m pip)
"${pip[@]}" --version >/dev/null 2>&1 || pip=(pip3)
if ! command -v cmake >/dev/null || ! command -v ninja >/dev/null; then
  tools="$root/build-tools"
  if [ ! -x "$tools/bin/cmake" ] || [ ! -x "$tools/bin/ninja" ]; then
    "${pip[@]}" install --quiet --target "$tools" cmake==4.1.2 ninja==1.13.0 >&2 ||
      "${pip[@]}" install --quiet --break-system-packages --target "$tools" cmake==4.1.2 ninja==1.13.0 >&2
  fi
  export PATH="$tools/bin:$PATH" PYTHONPATH="$tools${PYTHONPATH:+:$PYTHONPATH}"
fi
