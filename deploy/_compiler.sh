# Sourced by dev.sh and deploy/ci-static-checks.sh:
#   ensure_compiler PYTHON   make sure pip can build attnserve's C modules
#                            (gpu/_commands.c, plane/_callframe.c: setup.py) for PYTHON:
#                            a C compiler on PATH and PYTHON's headers (Python.h),
#                            installing gcc, libc6-dev and python3-dev through apt
#                            for what is missing.
# python3-dev gives the headers of Debian's own python3; an interpreter built
# elsewhere (pyenv, a container's) ships its headers itself, and without them this
# says so and fails rather than letting pip fail later with a compiler error.

has_compiler() {
  type -P gcc >/dev/null 2>&1 || type -P cc >/dev/null 2>&1
}

# Asked on stdin, as has_adapter asks: a stand-in Python in the tests answers both.
has_python_headers() {
  "$1" - <<'PYEOF' 2>/dev/null
import os, sys, sysconfig
sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")) else 1)
PYEOF
}

ensure_compiler() {
  local py="$1" sudo="" need=()
  has_compiler || need+=(gcc libc6-dev)
  has_python_headers "$py" || need+=(python3-dev)
  if [ "${#need[@]}" -eq 0 ]; then return 0; fi
  echo "no C compiler or Python headers for attnserve's C module; installing ${need[*]} through apt" >&2
  if [ "$(id -u)" != 0 ]; then sudo="sudo"; fi
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
  hash -r  # find the new programs
  if ! has_compiler; then
    echo "still no C compiler (gcc or cc) on PATH after installing gcc" >&2
    return 1
  fi
  if ! has_python_headers "$py"; then
    echo "still no Python.h for $py after installing python3-dev: install its headers (its own -dev package)" >&2
    return 1
  fi
}
