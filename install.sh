#!/usr/bin/env bash
# Install dsq into the current Python environment (a venv is recommended).
#
#   ./install.sh              dsq and everything it needs to run
#   ./install.sh --dev        plus the test tools (pytest, transformers as the reference implementation)
#   --with-qemu               with --dev on x86-64: also apt-get install an aarch64 cross compiler and
#                             qemu (as root), for the NEON kernel test, without asking
#   --no-apt                  never run apt-get (the NEON kernel test then skips)
#   --rebuild-llama           build llama-cpp-python again even where the installed one would do
#                             (DSQ_INSTALL_APT=yes or =no in the environment says the same)
#   -h, --help                this text
#
# Without --with-qemu or --no-apt, --dev asks before running apt-get on a terminal, and skips it
# (saying how to get it) when there is no terminal to ask on.
#
# How long: PyTorch and the rest download in a minute or two. llama-cpp-python is compiled here:
# about 7 minutes on two idle cores, and it took 30 on a busy two-core machine; its progress is
# shown as it builds (the full log goes to a file, named when the build fails). The test suite
# (`python3 -m pytest -q`) then takes about 35 minutes on two cores.
#
# Two choices a plain `pip install -e .` would get wrong:
# - PyTorch: with no NVIDIA GPU, the CPU build (a plain `torch` requirement pulls a multi-GB CUDA
#   build). Set DSQ_TORCH_INDEX to a wheel index (e.g. https://download.pytorch.org/whl/cpu) to
#   choose where it comes from.
# - llama-cpp-python is compiled here: with CUDA when nvcc is present, otherwise for the CPU with
#   explicit SIMD flags and no AMX (llama.cpp's CPU AMX path crashes on some machines). The CUDA
#   build links with --exclude-libs,ALL: otherwise its CUDA library exports a copy of the C++
#   runtime, and loading a model in a process that has loaded PyTorch segfaults.
set -euo pipefail

PY="${PYTHON:-python3}"

say() { echo "install.sh: $*"; }
pipi() { "$PY" -m pip install --disable-pip-version-check "$@"; }
have_gpu() { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
usage() { sed -n '2,/^set -euo/p' "${BASH_SOURCE[0]}" | sed '$d' | sed 's/^# \{0,1\}//'; }

# build_progress LOG: read a build's output on stdin, keep all of it in LOG, and print a line at
# each tenth of the compile steps (ninja's [n/N] or make's [ n%] lines) and at least every minute.
build_progress() {
  local log="$1" start=$SECONDS last=$SECONDS shown=-1 line done tenth
  : >"$log"
  while IFS= read -r line; do
    printf '%s\n' "$line" >>"$log"
    done=""
    if [[ "$line" =~ ^[[:space:]]*\[[[:space:]]*([0-9]+)/([0-9]+)\] ]]; then
      tenth=$((10 * BASH_REMATCH[1] / BASH_REMATCH[2])) done="${BASH_REMATCH[1]} of ${BASH_REMATCH[2]} steps"
    elif [[ "$line" =~ ^[[:space:]]*\[[[:space:]]*([0-9]+)%\] ]]; then
      tenth=$((BASH_REMATCH[1] / 10)) done="${BASH_REMATCH[1]}%"
    fi
    if [ -n "$done" ]; then
      if [ "$tenth" -ne "$shown" ] || [ $((SECONDS - last)) -ge 60 ]; then
        shown=$tenth last=$SECONDS
        say "  compiling llama.cpp: $done ($(elapsed $((SECONDS - start))))"
      fi
    elif [ $((SECONDS - last)) -ge 60 ]; then
      last=$SECONDS
      say "  still building ($(elapsed $((SECONDS - start))))"
    fi
  done
}

elapsed() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

# apt_allowed: whether --dev may apt-get install the NEON test tools: --with-qemu yes, --no-apt
# no, otherwise ask on a terminal (no terminal: no, saying how to get them)
apt_allowed() {
  case "$APT" in
    yes) return 0 ;;
    no) return 1 ;;
  esac
  if [ ! -t 0 ]; then
    say "not running apt-get without asking (no terminal): pass --with-qemu to install $1, or --no-apt"
    return 1
  fi
  local answer
  read -r -p "install.sh: apt-get install $1 (for the NEON kernel test)? [y/N] " answer
  [[ "$answer" =~ ^[Yy] ]]
}

# --dev on x86-64: a cross compiler and qemu, so tests/test_kernels_neon_qemu.py can check the
# aarch64 NEON kernels (as root with apt; without them that test skips)
neon_test_tools() {
  [ "$(uname -m)" = "x86_64" ] || return 0
  command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 && [ -d /usr/aarch64-linux-gnu/include ] &&
    { command -v qemu-aarch64 || command -v qemu-aarch64-static; } >/dev/null 2>&1 && return 0
  local pkgs="gcc-aarch64-linux-gnu libc6-dev-arm64-cross qemu-user"
  if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    say "the NEON kernel test will skip: it needs $pkgs (root and apt-get install them)"
    return 0
  fi
  apt_allowed "$pkgs" || { say "the NEON kernel test will skip"; return 0; }
  export DEBIAN_FRONTEND=noninteractive
  if apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1 ||
     { apt-get update -qq >/dev/null 2>&1 &&
       apt-get install -y -qq --no-install-recommends $pkgs >/dev/null 2>&1; }; then
    say "installed $pkgs (for the NEON kernel test)"
  else
    say "apt-get could not install $pkgs: the NEON kernel test will skip"
  fi
}

install_torch() {
  "$PY" -c "import torch" >/dev/null 2>&1 && return 0
  if have_gpu; then
    say "NVIDIA GPU found: installing PyTorch with CUDA"
    pipi "torch>=2.4"
  elif [ -n "${DSQ_TORCH_INDEX:-}" ]; then
    pipi torch --index-url "$DSQ_TORCH_INDEX"
  else
    say "no GPU: installing the CPU build of PyTorch"
    pipi "torch==2.13.0"
  fi
}

# cpu_cmake_args: llama.cpp's CPU code for this CPU's instruction sets, named one by one (no
# -march=native, which would also turn on the AMX path that crashes)
cpu_cmake_args() {
  [ "$(uname -m)" = "x86_64" ] || return 0
  local flags f on args="-DGGML_NATIVE=OFF"
  flags=" $(grep -m1 -w '^flags' /proc/cpuinfo 2>/dev/null) "
  for f in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512; do
    on=OFF; [[ "$flags" == *" ${f%%:*} "* ]] && on=ON
    args="$args -DGGML_${f#*:}=$on"
  done
  echo "$args -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
}

llama_cmake_args() {
  if have_gpu && command -v nvcc >/dev/null 2>&1; then
    echo "-DGGML_CUDA=on -DCMAKE_SHARED_LINKER_FLAGS=-Wl,--exclude-libs,ALL $(cpu_cmake_args)"
  else
    cpu_cmake_args
  fi
}

# llama_build: what the installed llama-cpp-python was compiled with ("" when it does not import):
# its CPU features as llama.cpp lists them, and whether it offloads to a GPU
llama_build() {
  "$PY" - 2>/dev/null <<'PY' || true
import llama_cpp
info = llama_cpp.llama_print_system_info().decode("utf-8", "replace")
cpu = [kv.split("=")[0].replace("CPU :", "").strip() for kv in info.split("|") if kv.strip().endswith("= 1")]
gpu = "GPU offload" if llama_cpp.llama_supports_gpu_offload() else "no GPU offload"
print(f"llama-cpp-python {llama_cpp.__version__}: {' '.join(cpu)}; {gpu}")
PY
}

# llama_build_fits BUILD: whether an installed build is one this script would have made: no AMX,
# and GPU offload where this machine can build it
llama_build_fits() {
  [[ "$1" != *AMX* ]] || return 1
  if have_gpu && command -v nvcc >/dev/null 2>&1; then [[ "$1" == *"; GPU offload"* ]] || return 1; fi
  return 0
}

install_llama_cpp() {
  local built log="${TMPDIR:-/tmp}/dsq-llama-cpp-build.log" start=$SECONDS why="" force=()
  built=$(llama_build)
  if [ -n "$built" ]; then
    if [ "$REBUILD_LLAMA" != yes ] && llama_build_fits "$built"; then
      say "keeping the installed $built (./install.sh --rebuild-llama builds it again)"
      return 0
    fi
    why="replacing $built"; force=(--force-reinstall --no-deps)
    [ "$REBUILD_LLAMA" = yes ] || why="$why (not built by install.sh: AMX, or no GPU offload on a GPU machine)"
    say "$why"
  fi
  export CMAKE_ARGS="${CMAKE_ARGS:-$(llama_cmake_args)}"
  say "building llama-cpp-python from source (about 7 minutes on two idle cores, up to 30 on a busy machine;"
  say "  CMAKE_ARGS=${CMAKE_ARGS}; full log: $log)"
  # --no-binary and no cache: a wheel pip built before, or one from an index, was compiled with
  # other flags (seen: a cached wheel with the AMX path on)
  if ! pipi -v --no-cache-dir --no-binary llama-cpp-python ${force[@]+"${force[@]}"} "llama-cpp-python>=0.3.8" 2>&1 |
       build_progress "$log"; then
    tail -n 30 "$log"
    say "building llama-cpp-python failed after $(elapsed $((SECONDS - start))); the full log is $log"
    exit 1
  fi
  built=$(llama_build)
  if ! grep -q -E "Building wheel for llama-cpp-python|Created wheel for llama-cpp-python" "$log"; then
    say "error: pip installed llama-cpp-python without building it (see $log)"
    exit 1
  fi
  say "built ${built:-llama-cpp-python} in $(elapsed $((SECONDS - start)))"
  if [ -z "$CMAKE_ARGS_GIVEN" ] && ! llama_build_fits "$built"; then
    say "error: the build does not have the flags asked for (CMAKE_ARGS above); the full log is $log"
    exit 1
  fi
}

main() {
  local extra="" a
  APT=${DSQ_INSTALL_APT:-ask} REBUILD_LLAMA=no CMAKE_ARGS_GIVEN=${CMAKE_ARGS:-}
  for a in "$@"; do
    case "$a" in
      --dev) extra="[dev]" ;;
      --with-qemu) APT=yes ;;
      --no-apt) APT=no ;;
      --rebuild-llama) REBUILD_LLAMA=yes ;;
      -h|--help) usage; return 0 ;;
      *) echo "install.sh: unknown option $a (see ./install.sh --help)" >&2; return 2 ;;
    esac
  done
  cd "$(dirname "${BASH_SOURCE[0]}")"
  install_torch
  install_llama_cpp
  pipi -e ".$extra"
  if [ -n "$extra" ]; then neon_test_tools; fi
  say "done. Try: dsq run -p \"The history of the Roman Empire\" --max-tokens 32"
}

# sourced (the tests do, for its functions): define them only
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi
main "$@"
