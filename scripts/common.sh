# Sourced by the scripts in this folder.

# Makes sure the build's dependencies are there. As root on Debian/Ubuntu it installs what is
# missing; otherwise it prints the exact command.

ensure_dependencies() {
  local missing=()
  command -v cmake >/dev/null 2>&1 || missing+=(cmake)
  [ -f /usr/include/eigen3/Eigen/Dense ] || missing+=(libeigen3-dev)
  [ -f /usr/include/doctest/doctest.h ] || missing+=(doctest-dev)
  if ! command -v nvcc >/dev/null 2>&1; then
    if [ -x /usr/local/cuda/bin/nvcc ]; then
      export PATH="/usr/local/cuda/bin:$PATH"
    else
      echo "nvcc not found: install the CUDA Toolkit (https://developer.nvidia.com/cuda-downloads)" >&2
      echo "and put its bin/ folder on PATH." >&2
      return 1
    fi
  fi
  [ ${#missing[@]} -eq 0 ] && return 0
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "installing ${missing[*]}"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}"
  else
    echo "missing packages; install them with:" >&2
    echo "  sudo apt-get update && sudo apt-get install -y ${missing[*]}" >&2
    return 1
  fi
}

# Builds the chapters whose two-digit numbers are given (all when none are) and leaves their folder
# names in the array `chapters`: build_chapters 08 09.
build_chapters() {
  chapters=()
  local dir name
  for dir in chapters/*/; do
    name=$(basename "$dir")
    if [ $# -eq 0 ] || [[ " $* " == *" ${name:0:2} "* ]]; then chapters+=("$name"); fi
  done
  [ ${#chapters[@]} -gt 0 ] || { echo "no chapter numbered $*" >&2; return 2; }
  cmake --preset default >/dev/null
  cmake --build --preset default -j "$(nproc)" --target "${chapters[@]}" >/dev/null
}

# Exits with status 3 and one sentence when this machine cannot run the kernels (no GPU, no driver):
# asks the smallest chapter binary, which knows why (common/device.cpp). Builds it first if needed.
require_gpu() {
  cmake --preset default >/dev/null
  cmake --build --preset default -j "$(nproc)" --target 01_naive >/dev/null
  local why status=0
  why=$(build/bin/01_naive --batch 1 --heads 1 --seqlen 1 --no-bench --no-check 2>&1 >/dev/null) ||
    status=$?
  if [ $status -eq 3 ]; then
    echo "${0##*/}: ${why#01_naive: }" >&2
    exit 3
  fi
}

# True when the chapter (its folder name) is a decode chapter: CMakeLists.txt adds it with
# add_decode_chapter. Decode chapters take other shapes (a few new tokens against a KV cache).
is_decode_chapter() {
  grep -q "^add_decode_chapter($1)" CMakeLists.txt
}

# True when the built decode chapter reads a paged cache: its --help lists --page-size.
is_paged_chapter() {
  [[ "$(build/bin/"$1" --help)" == *--page-size* ]]
}
