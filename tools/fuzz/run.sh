#!/usr/bin/env bash
# The call frame's parser and step checks (service/attnserve/plane/callframe.c)
# under the sanitizers (issue 53 item 7; docs/architecture.md, "The call frame's
# parser, as built"). Run by .ci/run; on a developer machine as well:
#
#   bash tools/fuzz/run.sh               the whole run (below)
#   bash tools/fuzz/run.sh --toolchain   only make sure clang with libFuzzer is there
#
#   1. clang with libFuzzer and the sanitizer runtimes: installed through apt when
#      missing or when -fsanitize=fuzzer does not link (Debian 12: clang 14 and
#      libclang-rt-14-dev, which clang only recommends);
#   2. the C unit driver (callframe_test.c) built with ASan+UBSan and run;
#   3. the libFuzzer target (callframe_fuzz.c) built with -fsanitize=fuzzer,address,
#      undefined, run once over the seed corpus (seed_corpus.py: valid and mutated
#      frames), then fuzzed for ATTNSERVE_FUZZ_SECONDS (default 60);
#   4. tests/test_callframe.py once against a build of the Python module with ASan
#      and UBSan (gcc's, LD_PRELOADed into the interpreter: the module is loaded by
#      a Python that was not built with them).
# Any crash, sanitizer report or failed test fails the script; a crashing input is
# kept in $ATTNSERVE_FUZZ_DIR (default build/fuzz) as crash-* for replay:
#   build/fuzz/callframe_fuzz build/fuzz/crash-...
set -euo pipefail
cd "$(dirname "$0")/../.."
FUZZ_SECONDS="${ATTNSERVE_FUZZ_SECONDS:-60}"
OUT="${ATTNSERVE_FUZZ_DIR:-build/fuzz}"
PY="${PYTHON:-.venv/bin/python}"
SRC=service/attnserve/plane
SAN=(-fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g -O1)
CFLAGS_WARN=(-std=c11 -Wall -Wextra -Werror)

say() { echo "fuzz: $*" >&2; }

# a clang on PATH: clang, else the newest clang-N
find_clang() {
  local c
  for c in clang clang-19 clang-18 clang-17 clang-16 clang-15 clang-14; do
    if type -P "$c" >/dev/null 2>&1; then echo "$c"; return 0; fi
  done
  return 1
}

# whether $1 links a libFuzzer target with ASan and UBSan
links_fuzzer() {
  local dir
  dir="$(mktemp -d)"
  printf '%s\n' '#include <stdint.h>' '#include <stddef.h>' \
    'int LLVMFuzzerTestOneInput(const uint8_t *d, size_t n) { (void)d; (void)n; return 0; }' > "$dir/t.c"
  "$1" -fsanitize=fuzzer,address,undefined "$dir/t.c" -o "$dir/t" >/dev/null 2>&1
  local rc=$?
  rm -rf "$dir"
  return $rc
}

# apt-get install, quiet (its log shown only when it fails), three tries
apt_install() {
  local sudo="" try log
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  log="$(mktemp)"
  for try in 1 2 3; do
    if { [ -n "${APT_UPDATED:-}" ] || $sudo apt-get update -qq >"$log" 2>&1; } \
      && DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "$@" >>"$log" 2>&1; then
      APT_UPDATED=1
      rm -f "$log"
      return 0
    fi
    say "apt-get install $* failed (try $try of 3):"
    tail -n 5 "$log" >&2
    APT_UPDATED=""
    sleep $((try * 5))
  done
  rm -f "$log"
  return 1
}

ensure_clang() {
  local cc major
  if cc="$(find_clang)" && links_fuzzer "$cc"; then CLANG="$cc"; return 0; fi
  if [ -z "${cc:-}" ]; then
    say "no clang: installing clang through apt ..."
    apt_install clang
    hash -r
    cc="$(find_clang)" || { say "still no clang on PATH after installing it"; return 1; }
  fi
  if ! links_fuzzer "$cc"; then
    # Debian and Ubuntu ship libFuzzer and the sanitizer runtimes apart from clang
    # (from LLVM 14 on: libclang-rt-N-dev, a recommendation of clang's)
    major="$("$cc" -dumpversion | cut -d. -f1)"
    say "$cc cannot link -fsanitize=fuzzer: installing libclang-rt-$major-dev ..."
    apt_install "libclang-rt-$major-dev"
    links_fuzzer "$cc" || { say "$cc still cannot link -fsanitize=fuzzer,address,undefined"; return 1; }
  fi
  CLANG="$cc"
}

start=$(date +%s)
ensure_clang
say "toolchain: $("$CLANG" --version | head -n 1) ($(($(date +%s) - start)) s)"
if [ "${1:-}" = --toolchain ]; then exit 0; fi
if [ ! -x "$PY" ]; then
  say "no $PY: the seed corpus and the Python tests run in the project's venv (./dev.sh test makes it; or set PYTHON)"
  exit 1
fi

mkdir -p "$OUT"
export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:strict_string_checks=1:detect_stack_use_after_return=1"
export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"

# 2. the C unit driver
"$CLANG" "${CFLAGS_WARN[@]}" "${SAN[@]}" -I"$SRC" tools/fuzz/callframe_test.c "$SRC/callframe.c" -o "$OUT/callframe_test"
"$OUT/callframe_test"

# 3. the fuzz target: the corpus once, then fuzzing from it (new inputs go to a
# scratch copy, so the seed corpus stays what seed_corpus.py writes)
"$CLANG" "${CFLAGS_WARN[@]}" -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer \
  -g -O1 -I"$SRC" tools/fuzz/callframe_fuzz.c "$SRC/callframe.c" -o "$OUT/callframe_fuzz"
rm -rf "$OUT/seeds" "$OUT/corpus"
"$PY" tools/fuzz/seed_corpus.py "$OUT/seeds"
mkdir -p "$OUT/corpus"
# -max_len: the largest seed is a frame of a few hundred bytes and the target reads
# a config prefix and a chain of frames and operations: 4 KiB leaves room for both
FUZZ_ARGS=(-max_len=4096 -timeout=10 -rss_limit_mb=2048 -artifact_prefix="$OUT/" -print_final_stats=1)
say "the seed corpus once ($(ls "$OUT/seeds" | wc -l) inputs) ..."
"$OUT/callframe_fuzz" "${FUZZ_ARGS[@]}" -runs=0 "$OUT/seeds" 2>"$OUT/seeds.log" \
  || { tail -n 60 "$OUT/seeds.log" >&2; exit 1; }
say "fuzzing for ${FUZZ_SECONDS} s ..."
"$OUT/callframe_fuzz" "${FUZZ_ARGS[@]}" -max_total_time="$FUZZ_SECONDS" "$OUT/corpus" "$OUT/seeds" \
  2>"$OUT/fuzz.log" || { tail -n 80 "$OUT/fuzz.log" >&2; exit 1; }
grep -E '^stat::(number_of_executed_units|average_exec_per_sec|new_units_added|peak_rss_mb)' "$OUT/fuzz.log" \
  | sed 's/^/fuzz: /' >&2

# 4. the Python module's tests under gcc's ASan and UBSan (the interpreter loads
# libasan first through LD_PRELOAD; PYTHONMALLOC=malloc puts Python's own objects,
# bytes included, under ASan's eye too; CPython's allocations at exit are not leaks
# of this module: detect_leaks=0)
rm -rf "$OUT/san" "$OUT/san-tmp"
say "tests/test_callframe.py against the module built with ASan and UBSan ..."
CC=gcc CFLAGS="${SAN[*]}" LDFLAGS="-fsanitize=address,undefined" \
  "$PY" setup.py -q build_ext --build-lib "$OUT/san" --build-temp "$OUT/san-tmp" >"$OUT/san-build.log" 2>&1 \
  || { cat "$OUT/san-build.log" >&2; exit 1; }
MODULE="$(ls "$OUT"/san/attnserve/plane/_callframe.*.so)"
ATTNSERVE_CALLFRAME_MODULE="$MODULE" LD_PRELOAD="$(gcc -print-file-name=libasan.so)" PYTHONMALLOC=malloc \
  ASAN_OPTIONS="detect_leaks=0:abort_on_error=1" PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 \
  "$PY" -m pytest -q --capture=sys -p no:cacheprovider -W ignore::pytest.PytestConfigWarning --noconftest tests/test_callframe.py
say "done in $(($(date +%s) - start)) s"
